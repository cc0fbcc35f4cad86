"""A server's side of `weight_push=http`: fetch an exported folder from the trainer, then load it.

In: the trainer's export URL, the folder's file names and sizes, a bearer token. Out: for the
embedded server, the files in a fresh local folder (fetched in parallel), handed to its loader,
then deleted; for vLLM (`WeightFetch`, a worker extension), the safetensors shards streamed
tensor by tensor into vLLM's in-place reload, never written to disk. Standard library only (torch
inside vLLM), so the file also works alone: copied as harnessrl_fetch.py onto vLLM's PYTHONPATH,
`--worker-extension-cls=harnessrl_fetch.WeightFetch`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
CHUNK = 8 << 20  # bytes per read: large enough that Python's per-call cost does not show
FETCH_WORKERS = 8  # files fetched at once (an export has one shard per few GB)


def check_fetch(url: Any, files: Any) -> list[tuple[str, int]]:
    """`url` an http(s) folder URL and `files` [[name, size], ...] of plain names; else ValueError."""
    if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"url must be the trainer's http(s) export folder URL, got {url!r:.200}")
    if not isinstance(files, list) or not files:
        raise ValueError(f"files must be a non-empty list of [name, size], got {files!r:.200}")
    checked = []
    for item in files:
        ok = isinstance(item, list | tuple) and len(item) == 2
        name, size = item if ok else ("", -1)
        if not (isinstance(name, str) and name and "/" not in name and name not in (".", "..")):
            raise ValueError(f"files: {item!r:.100} is not [plain file name, size]")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"files: {item!r:.100} has no size in bytes")
        checked.append((name, size))
    return checked


def _open(url: str, name: str, token: str, timeout_s: float) -> Any:
    request = urllib.request.Request(f"{url.rstrip('/')}/{urllib.parse.quote(name)}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    return urllib.request.urlopen(request, timeout=timeout_s)


def _fetch_one(url: str, name: str, size: int, dest: Path, token: str, timeout_s: float) -> None:
    got = 0
    with _open(url, name, token, timeout_s) as resp, (dest / name).open("wb") as f:
        while chunk := resp.read(CHUNK):
            f.write(chunk)
            got += len(chunk)
    if got != size:  # a cut connection must not load as a truncated shard
        raise OSError(f"{name}: got {got} of {size} bytes from {url}")


def fetch_export(
    url: str, files: Any, dest: Path, token: str = "", timeout_s: float = 600.0
) -> Path:
    """Every file of the export at `url` into `dest`, in parallel; `dest` is returned."""
    checked = check_fetch(url, files)
    dest.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(min(FETCH_WORKERS, len(checked))) as pool:
        jobs = [pool.submit(_fetch_one, url, n, s, dest, token, timeout_s) for n, s in checked]
        for job in jobs:
            job.result()  # the first failure is raised
    return dest


def with_fetched(fields: dict[str, Any], use: Callable[[str], T]) -> T:
    """`use(folder)` on a temporary local copy of the export `fields` names (url, files, token)."""
    folder = Path(tempfile.mkdtemp(prefix="harnessrl-weights-"))
    try:
        fetch_export(
            fields.get("url", ""), fields.get("files"), folder, str(fields.get("token") or "")
        )
        return use(str(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _read_exact(resp: Any, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = resp.readinto(view[got:])
        if not n:
            raise OSError(f"the export stream ended after {got} of {size} bytes")
        got += n
    return buf


def stream_tensors(
    url: str, files: Any, token: str = "", timeout_s: float = 600.0
) -> Iterator[Any]:
    """(name, torch tensor) for every tensor of the export's *.safetensors shards, in file order,
    read straight off the HTTP stream (the safetensors layout: 8-byte header size, JSON header,
    then each tensor's bytes at its offsets)."""
    import torch

    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip
    for name, _ in check_fetch(url, files):
        if not name.endswith(".safetensors"):
            continue
        with _open(url, name, token, timeout_s) as resp:
            header = json.loads(_read_exact(resp, int.from_bytes(_read_exact(resp, 8), "little")))
            header.pop("__metadata__", None)
            at = 0
            for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                start, end = info["data_offsets"]
                _read_exact(resp, start - at)  # padding between tensors, if any
                data, at = _read_exact(resp, end - start), end
                dtype, shape = dtypes[info["dtype"]], info["shape"]
                tensor = (
                    torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
                )
                yield key, tensor.reshape(shape)


class WeightFetch:
    """vLLM worker extension: `POST /collective_rpc` with method `reload_weights_from_url` makes
    each worker stream the export's tensors into vLLM's own in-place `reload_weights`."""

    def reload_weights_from_url(self, url: str, files: Any, token: str = "") -> None:
        worker: Any = self  # mixed into vLLM's worker class, which has reload_weights
        worker.reload_weights(weights_iterator=stream_tensors(url, files, token))
