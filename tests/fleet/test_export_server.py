"""The trainer's export server and a server's fetch of it (`weight_push=http`), over real HTTP."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from harnessrl.fleet.export_server import ExportServer, parse_address
from harnessrl.serve.weight_fetch import check_fetch, fetch_export, with_fetched


def exports(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "weights"
    folder = root / "v000003"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (tmp_path / "secret.txt").write_text("not an export")
    return root, folder


def test_servers_fetch_exactly_the_exported_files(tmp_path: Path) -> None:
    root, folder = exports(tmp_path)
    server = ExportServer(root)
    try:
        fields = server.fetch_fields(folder)
        assert fields["url"] == f"http://127.0.0.1:{server.port}/v000003"
        assert fields["files"] == [["config.json", 2], ["model.safetensors", 1 << 20]]
        got = fetch_export(fields["url"], fields["files"], tmp_path / "copy", fields["token"])
        for name in ("config.json", "model.safetensors"):
            assert (got / name).read_bytes() == (folder / name).read_bytes()
        used: list[Path] = []
        seen = with_fetched(fields, lambda p: used.append(Path(p)) or sorted(os.listdir(p)))
        assert seen == ["config.json", "model.safetensors"]
        assert not used[0].exists(), "the local copy is deleted once loaded"
        url = f"http://127.0.0.1:{server.port}"
        auth = {"Authorization": f"Bearer {fields['token']}"}
        assert httpx.get(f"{url}/v000003/config.json").status_code == 401
        assert httpx.get(f"{url}/v000003/config.json", headers={"Authorization": "Bearer x"}).status_code == 401  # fmt: skip
        for path in ("/../secret.txt", "/v000003/../../secret.txt", "/v000003", "/v000003/x/y"):
            assert httpx.get(url + path, headers=auth).status_code == 404, path
        # A size that does not match what came (a cut transfer) fails the fetch.
        with pytest.raises(OSError, match="got 2 of 3 bytes"):
            fetch_export(fields["url"], [["config.json", 3]], tmp_path / "c2", fields["token"])
        with pytest.raises(ValueError, match="not a folder of the export root"):
            server.fetch_fields(tmp_path)
    finally:
        server.stop()


def test_bad_fetch_requests_and_addresses_are_named() -> None:
    with pytest.raises(ValueError, match="url must be"):
        check_fetch("file:///etc", [["a", 1]])
    for files in ([], [["../a", 1]], [["a", -1]], [["a"]], "a"):
        with pytest.raises(ValueError, match="files"):
            check_fetch("http://t:1/v1", files)
    assert parse_address("10.0.0.5:9000") == ("10.0.0.5", 9000)
    assert parse_address("") == ("127.0.0.1", 0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("10.0.0.5")


def test_vllm_workers_stream_the_same_tensors_safetensors_reads(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from harnessrl.serve.weight_fetch import stream_tensors

    root = tmp_path / "weights"
    folder = root / "v000001"
    folder.mkdir(parents=True)
    shard_a = {
        "model.embed_tokens.weight": torch.randn(5, 3, dtype=torch.bfloat16),
        "model.norm.weight": torch.randn(3),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    shard_b = {"lm_head.weight": torch.randn(7, 3), "step": torch.tensor([3], dtype=torch.int64)}
    save_file(shard_a, str(folder / "model-00001-of-00002.safetensors"))
    save_file(shard_b, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "config.json").write_text("{}")
    server = ExportServer(root)
    try:
        fields = server.fetch_fields(folder)
        streamed = dict(stream_tensors(fields["url"], fields["files"], fields["token"]))
    finally:
        server.stop()
    expected = {**shard_a, **shard_b}
    assert streamed.keys() == expected.keys()
    for name, tensor in expected.items():
        assert streamed[name].dtype == tensor.dtype and torch.equal(streamed[name], tensor), name
    assert load_file(str(folder / "model-00002-of-00002.safetensors")).keys() == shard_b.keys()
