"""Benchmark: weight push time per GB and per replica count, each push path side by side.

Real embedded servers (`harnessrl.serve`, warm-up off) on this machine get one exported model
(`--mb` MB of float32 weights) pushed through `EmbeddedSync`, for 1, 2 and 4 replicas:
`shared_serial` (every server loads the folder from the export root, one after the other: the
old path), `shared` (all at once) and `http` (every server fetches the folder from the trainer's
`ExportServer` at once, then loads its own copy). Each figure is the median of `--rounds` pushes,
wall clock from the first request to the last answer. With `HARNESSRL_VLLM_PYTHON` set (a vLLM
CPU interpreter) and `--vllm-model HF_FOLDER`, one vLLM server started with the worker extension
(harnessrl/serve/weight_fetch.py) is pushed that folder both ways (`VLLMSync`) too.
Unthrottled, the export root is this machine's page cache: the best case for the shared paths.
`--shared-mib-s 100` makes every read of the export root share that bandwidth, as all servers
share one Filestore Basic HDD instance's (about 100 MiB/s); the http path's fetch from the
trainer and its local copy stay unthrottled, as a cluster network's 10+ Gbit/s would be.
Last line: `weight_sync: gb=<g> shared_serial_s_per_gb_n1=<x> ... http_s_per_gb_n4=<y>
speedup_n4=<shared_serial / http at 4 replicas>`.
"""

from __future__ import annotations

import argparse
import functools
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from harnessrl.fleet.export_server import ExportServer
from harnessrl.fleet.weight_sync import EmbeddedSync, VLLMSync, VLLMSyncConfig

MODES = ("shared_serial", "shared", "http")
REPLICAS = (1, 2, 4)


def sized_model(mb: int) -> Any:
    """A random decoder with about `mb` MB of float32 weights (mostly its layers' matmuls)."""
    from flax import nnx

    from harnessrl.model.families.dense.config import ModelConfig
    from harnessrl.model.families.dense.decoder import Decoder

    hidden = 512
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * 4 * hidden)  # attention + MLP, bytes
    layers = max(1, round(mb * 1e6 / per_layer))
    cfg = ModelConfig.tiny(
        vocab_size=258, eos_token_id=257, hidden_size=hidden, intermediate_size=4 * hidden,
        num_layers=layers, num_heads=8, num_kv_heads=8, head_dim=hidden // 8,
    )  # fmt: skip
    return Decoder(cfg, rngs=nnx.Rngs(0))


class Bytes:
    eos_token_ids = (257,)

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        return [256, *"".join(m.get("content") or "" for m in messages).encode(), 257]


class SharedDisk:
    """Reads of `root` at `mib_s` MiB/s for all readers together (one shared disk), then the
    server's own loader; reads elsewhere (an http push's local copy) are not slowed."""

    def __init__(self, root: Path, mib_s: float) -> None:
        from harnessrl.engine.swap import load_params

        self.root, self.bytes_s, self.load = root.resolve(), mib_s * (1 << 20), load_params
        self._lock, self._free_at = threading.Lock(), 0.0

    def __call__(self, path: str) -> Any:
        folder = Path(path).resolve()
        if self.bytes_s > 0 and folder.is_relative_to(self.root):
            for file in sorted(folder.iterdir()):
                with file.open("rb") as f:
                    while chunk := f.read(8 << 20):
                        with self._lock:  # the chunk's turn on the disk, after everyone's before
                            start = max(time.monotonic(), self._free_at)
                            self._free_at = start + len(chunk) / self.bytes_s
                        time.sleep(max(0.0, self._free_at - time.monotonic()))
        return self.load(path)


def timed(push: Callable[[int], None], rounds: int, first_version: int) -> float:
    """Median seconds of `rounds` pushes (a new version each)."""
    times = []
    for i in range(rounds):
        t0 = time.perf_counter()
        push(first_version + i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_embedded(args: argparse.Namespace, root: Path) -> tuple[float, dict[str, float]]:
    from harnessrl.model.formats.export import export_hf
    from harnessrl.serve.app import start_server
    from harnessrl.serve.config import ServeConfig

    model = sized_model(args.mb)
    folder = export_hf(model, root / "v000001")
    gb = sum(p.stat().st_size for p in folder.iterdir()) / 1e9
    print(f"export: {gb * 1000:.0f} MB in {folder}", flush=True)
    token = secrets.token_urlsafe(16)  # one admin token for every replica, as a fleet has
    serve = ServeConfig(
        port=0,
        num_slots=1,
        max_model_len=64,
        prefill_buckets=(16,),
        warmup=False,
        admin_token=token,
    )
    disk = SharedDisk(root, args.shared_mib_s)
    servers = [
        start_server(sized_model(args.mb), Bytes(), serve, params_loader=disk)
        for _ in range(max(REPLICAS))
    ]
    source = ExportServer(root)
    version, results = 1, {}
    try:
        for n in REPLICAS:
            urls = [s.url for s in servers[:n]]
            syncs = {
                "shared_serial": EmbeddedSync(urls, parallel=False, admin_token=token),
                "shared": EmbeddedSync(urls, admin_token=token),
                "http": EmbeddedSync(urls, source=source, admin_token=token),
            }
            for mode in MODES:
                sync = syncs[mode]
                seconds = timed(functools.partial(sync.push, folder), args.rounds, version)
                version += args.rounds
                results[f"{mode}_s_per_gb_n{n}"] = seconds / gb
                print(
                    f"  {n} replica(s) {mode:>13}: {seconds:6.2f} s/push  {seconds / gb:6.1f} s/GB"
                )
    finally:
        source.stop()
        for s in servers:
            s.stop()
    return gb, results


def run_vllm(args: argparse.Namespace, root: Path) -> dict[str, float]:
    """One vLLM CPU server (worker extension on): its own model folder pushed both ways."""
    python, model = os.environ["HARNESSRL_VLLM_PYTHON"], Path(args.vllm_model).resolve()
    if not any(model.glob("*.safetensors")):
        raise ValueError(f"--vllm-model must be an HF folder with safetensors, got {model}")
    folder = root / "v000100"  # under the export root, where ExportServer serves it from
    shutil.copytree(model, folder)
    gb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9
    port, repo = 18000 + os.getpid() % 1000, Path(__file__).resolve().parents[2]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(repo)}  # fmt: skip
    log = (root / "vllm.log").open("w")
    proc = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--dtype", "bfloat16", "--max-model-len", "512", "--host", "127.0.0.1",
         "--port", str(port), "--worker-extension-cls", "harnessrl.serve.weight_fetch.WeightFetch"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url, source, results = f"http://127.0.0.1:{port}", ExportServer(root), {}
    try:
        deadline = time.monotonic() + 1500
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((root / "vllm.log").read_text()[-3000:])
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(5)
        cfg = VLLMSyncConfig(urls=(url,))
        for mode, sync in (("shared", VLLMSync(cfg)), ("http", VLLMSync(cfg, source=source))):
            seconds = timed(functools.partial(sync.push, folder), args.rounds, 100)
            results[f"vllm_{mode}_s_per_gb_n1"] = seconds / gb
            print(f"  vLLM 1 replica {mode:>6}: {seconds:6.2f} s/push  {seconds / gb:6.1f} s/GB")
    finally:
        source.stop()
        proc.terminate()
        proc.wait(timeout=60)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="exported weights, MB (float32)")
    parser.add_argument("--rounds", type=int, default=3, help="pushes per figure (median)")
    parser.add_argument(
        "--shared-mib-s", type=float, default=0.0,
        help="bandwidth of the shared export root for all servers together; 0: unthrottled",
    )  # fmt: skip
    parser.add_argument("--vllm-model", default="", help="HF folder for the vLLM part (optional)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="harnessrl-weight-sync-") as tmp:
        root = Path(tmp) / "weights"
        root.mkdir()
        gb, results = run_embedded(args, root)
        if os.environ.get("HARNESSRL_VLLM_PYTHON") and args.vllm_model:
            results |= run_vllm(args, root)
    speedup = results["shared_serial_s_per_gb_n4"] / results["http_s_per_gb_n4"]
    pairs = " ".join(f"{k}={v:.2f}" for k, v in results.items())
    shared = f"shared_mib_s={args.shared_mib_s:g}"
    print(f"weight_sync: gb={gb:.3f} {shared} {pairs} speedup_n4={speedup:.2f}")


if __name__ == "__main__":
    main()
