"""A throwaway PostgreSQL cluster for tests: `pg_server` (session) and `pg_dsn` (a fresh database).

The cluster is started with initdb/pg_ctl in a temp dir on a free port (as the `postgres` user when
the tests run as root) and removed afterwards. Without the server binaries those tests skip.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

_INSTALL_HINT = (
    "PostgreSQL server binaries (initdb, pg_ctl) not found; install them to run the PostgreSQL "
    "store tests, e.g. `apt-get install postgresql` (Debian/Ubuntu)"
)


def _pg_bindir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_server_user(cmd: list[str]) -> tuple[list[str], Any]:
    """PostgreSQL refuses to run as root: run it as the `postgres` (or `nobody`) user."""
    if os.geteuid() != 0:
        return cmd, None
    for name in ("postgres", "nobody"):
        try:
            user = pwd.getpwnam(name)
        except KeyError:
            continue
        return ["runuser", "-u", name, "--", *cmd], user
    pytest.skip("running as root and no 'postgres' or 'nobody' user to run PostgreSQL as")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip(_INSTALL_HINT)
    # As root the server runs as another user, who must be able to reach the data dir: /tmp is
    # world-traversable where a custom TMPDIR may not be.
    base = "/tmp" if os.geteuid() == 0 and os.path.isdir("/tmp") else None
    root = tempfile.mkdtemp(prefix="harnessrl-pg-", dir=base)
    data, sock = os.path.join(root, "data"), os.path.join(root, "sock")
    os.makedirs(sock)
    _, user = _as_server_user(["true"])
    if user is not None:
        for path in (root, sock):
            os.chown(path, user.pw_uid, user.pw_gid)
    port = _free_port()
    initdb, _ = _as_server_user(
        [f"{bindir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8"]
    )
    subprocess.run(initdb, check=True, capture_output=True, timeout=120)
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off"
    start, _ = _as_server_user(
        [f"{bindir}/pg_ctl", "-D", data, "-o", opts, "-l", f"{root}/log", "-w", "start"]
    )
    subprocess.run(start, check=True, capture_output=True, timeout=120)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        stop, _ = _as_server_user([f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "stop"])
        subprocess.run(stop, capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


_db_counter = itertools.count()


@pytest.fixture
def pg_dsn(pg_server: str) -> str:
    """A fresh, empty database on the session's cluster."""
    import psycopg

    name = f"t{os.getpid()}_{next(_db_counter)}"
    with psycopg.connect(f"{pg_server}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{pg_server}/{name}"
