"""Serving stage, admin edge: the bearer token of `/admin/*` and `POST /admin/load_weights`.

In: `ServeConfig.admin_token`, or none given: a new random token, handed to whoever starts the
server (the in-process handle; the CLI writes it to `admin_token_file` or a private temporary
file whose path it prints). Out: weight loads from callers holding it, one at a time.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from harnessrl.serve.body import read_json
from harnessrl.serve.config import ServeConfig
from harnessrl.serve.protocol import RequestError
from harnessrl.serve.weight_fetch import check_fetch, with_fetched
from harnessrl.traces.schema import policy_version_error

ParamsLoader = Callable[[str], Any]


def admin_token(config: ServeConfig) -> str:
    """`config.admin_token`, or a new one (written to `config.admin_token_file` if named)."""
    if config.admin_token:
        return config.admin_token
    token = secrets.token_urlsafe(32)
    if config.admin_token_file:
        write_private(Path(config.admin_token_file), token + "\n")
    return token


def private_token_file() -> Path:
    """Where the CLI puts a token when the caller names no file: in a new folder only this user
    can read (the folder exists; the file does not yet)."""
    return Path(tempfile.mkdtemp(prefix="harnessrl-serve-")) / "admin-token"


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by this user only; a reader never sees half of it."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def check_admin(request: Request, token: str) -> None:
    """The bearer token, before anything else of the request is read: one answer for every
    caller without it, whatever it asks."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), token.encode()
    ):
        raise RequestError(
            "missing or wrong bearer token for /admin (the server's admin token)",
            status=401,
            headers={"www-authenticate": "Bearer"},
        )


def _load_fields(body: Any) -> tuple[dict[str, Any], int]:
    """The checked body: `path` or `url` + `files` (+ `token`), and `version`."""
    fields = body if isinstance(body, dict) else {}
    path, version = fields.get("path"), fields.get("version")
    if fields.get("url") is not None:
        try:
            check_fetch(fields.get("url"), fields.get("files"))
        except ValueError as err:
            raise RequestError(str(err), param="url") from err
    elif not isinstance(path, str) or not path:
        raise RequestError(
            f"path must be the exported model folder, got {path!r:.200}", param="path"
        )
    if error := policy_version_error(version):
        raise RequestError(f"version {error}", param="version")
    assert isinstance(version, int)  # what policy_version_error accepts
    return fields, version


async def load_weights(request: Request) -> JSONResponse:
    """`{"path": "<exported HF folder>", "version": <int>}` → 200 `{"version": <int>}`; or, in
    place of the path, `url`, `files` and `token` of a trainer's export to fetch (weight_fetch).

    One load at a time: each holds a whole copy of the weights until it is swapped in. A load
    that arrives while another runs is refused at once (409) rather than queued: the train loop
    pushes one version after the other, so a second one at the same time is another caller.
    """
    state = request.app.state
    backend, loader, lock = state.backend, state.params_loader, state.load_lock
    check_admin(request, state.admin_token)  # before the body is even read
    with backend.body.budget.hold() as hold:
        body = await read_json(request.scope, request.receive, backend.body, hold, backend.offload)
    fields, version = _load_fields(body)
    if lock.locked():
        raise RequestError(
            "another load_weights is running; loads run one at a time: retry once it answers",
            status=409,
        )
    async with lock:
        source = fields.get("url") or fields.get("path")
        try:
            if fields.get("url") is not None:
                params = await asyncio.to_thread(with_fetched, fields, loader)
            else:
                params = await asyncio.to_thread(loader, str(fields["path"]))
            await asyncio.to_thread(backend.engine.swap_params, params, version)
        except Exception as err:  # any failure to load leaves the served weights as they were
            raise RequestError(
                f"cannot load weights from {source!r:.300}: {type(err).__name__}: {err!s:.500}",
                param="path",
            ) from err
    return JSONResponse({"version": backend.engine.version})
