"""A throwaway PostgreSQL cluster for tests: `pg_server` (session) and `pg_dsn` (a fresh database);
`pg_ctl` stops, starts and restarts that cluster (fault tests; each brings it back up).

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
import time
from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass
class PgCluster:
    """`pg_ctl` on the session's cluster: the server goes down and comes back on the same port."""

    bindir: str
    data: str
    opts: str
    log: str

    def _ctl(self, *args: str) -> None:
        cmd, _ = _as_server_user([f"{self.bindir}/pg_ctl", "-D", self.data, *args])
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`fast`: sessions are terminated, open transactions rolled back;
        `immediate`: as a crash, recovered from the WAL at the next start)."""
        self._ctl("-m", mode, "-w", "stop")

    def start(self) -> None:
        self._ctl("-o", self.opts, "-l", self.log, "-w", "start")

    def restart(self, mode: str = "fast", down_s: float = 0.0) -> None:
        """Stop, stay down `down_s` seconds, start: what a server restart or failover looks like."""
        self.stop(mode)
        try:
            time.sleep(down_s)
        finally:
            self.start()


_clusters: dict[str, PgCluster] = {}  # pg_server's URL → its cluster


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
    url = f"postgresql://postgres@127.0.0.1:{port}"
    _clusters[url] = PgCluster(bindir, data, opts, f"{root}/log")
    try:
        yield url
    finally:
        _clusters.pop(url)
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


@pytest.fixture
def pg_ctl(pg_server: str) -> Iterator[PgCluster]:
    """The session's cluster, to stop and start; it is running again after the test."""
    cluster = _clusters[pg_server]
    yield cluster
    import psycopg

    try:
        psycopg.connect(f"{pg_server}/postgres", connect_timeout=2).close()
    except psycopg.OperationalError:  # the test left it down (or it failed midway)
        cluster.start()
