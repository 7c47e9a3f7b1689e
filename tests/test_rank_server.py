"""Warm rank servers (config ``rank_server``): a rank forked by its user's
server must be indistinguishable from an exec'd one, and a server — a process
of the user, hostile to the daemon — must never make the daemon act on
another process, nor keep a job from starting.

Real daemons, real servers, real processes, the real second uid (nobody).
Which way a rank came is told by its parent: the daemon (exec) or a server
(its command line names rankserver_main.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import zipapp
from pathlib import Path

import psutil
import pytest
import trio
from conftest import _world_traversable_tmpdir, as_uid, shared_cluster

from gangd.client.api import connect

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # (nobody cannot run the venv's: it is under /root)

PROBE = textwrap.dedent('''\
    """What a program can see of how it was started."""
    import json, os, random, resource, signal, sys
    try:
        import numpy
        nprandom = float(numpy.random.random())
    except ImportError:
        nprandom = None
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
    mask = os.umask(0o022)
    print(json.dumps({
        "served": any(part.endswith(b"rankserver_main.py") for part in parent),
        "argv": sys.argv, "orig_argv": getattr(sys, "orig_argv", None), "path": sys.path, "executable": sys.executable,
        "env": dict(os.environ), "proc_env": sorted(open("/proc/self/environ", "rb").read().decode().strip("\\0").split("\\0")),
        "cwd": os.getcwd(), "umask": mask, "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
        "cgroup": open("/proc/self/cgroup").read(), "fds": sorted(os.listdir("/proc/self/fd")),
        "fd_targets": [os.readlink(f"/proc/self/fd/{fd}").split(":")[0] for fd in (0, 1, 2)],
        "sig": [status["SigBlk"].strip(), status["SigIgn"].strip(), status["SigCgt"].strip()],
        "handlers": {s.name: repr(signal.getsignal(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "threads": len(os.listdir("/proc/self/task")), "session_leader": os.getsid(0) == os.getpid(),
        "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")},
        "main": sorted(k for k in globals() if k.startswith("__")), "name": __name__, "file": __file__, "spec": repr(__spec__),
        "loader": type(__loader__).__name__, "stdio": [sys.stdout.isatty(), sys.stdout.line_buffering, sys.stdout.encoding, sys.stdin.encoding],
        "random": random.random(), "nprandom": nprandom, "pid": os.getpid(), "ppid": os.getppid(),
    }), flush=True)
    if os.environ.get("PROBE_SLEEP"):
        import time
        time.sleep(float(os.environ["PROBE_SLEEP"]))
''')


@pytest.fixture(scope="module")
def place():
    """A world-readable directory with the programs the jobs run."""
    directory = _world_traversable_tmpdir() / "programs"
    directory.mkdir(mode=0o755)
    (directory / "probe.py").write_text(PROBE)
    (directory / "probe.py").chmod(0o644)
    yield directory


@pytest.fixture(scope="module")
def cluster():
    with shared_cluster(1, rank_server=True) as running:
        yield running


def run(cluster, argv, nranks=1, *, env=None, cwd=None, uid=None, timeout=60.0) -> tuple[dict, dict[int, str], dict[int, str]]:
    """Submit a job (as ``uid``), wait for its end: (final record, stdout by rank, stderr by rank)."""

    def go():
        async def main():
            async with connect(cluster.dir) as gang:
                record = await gang.submit([str(a) for a in argv], nranks, env=env or {"PATH": "/usr/bin:/bin"}, cwd=str(cwd or "/"))
                with trio.fail_after(timeout):
                    final = await gang.wait_done(record["id"])
                out: dict = {"1": {}, "2": {}}
                async with gang.output(record["id"], follow=False) as chunks:
                    async for item in chunks:
                        where = out["1" if item["stream"] in (1, "stdout") else "2"]
                        where[str(item["rank"])] = where.get(str(item["rank"]), "") + item["data"].decode(errors="replace")
                return {"final": final, "out": out}

        return trio.run(main)

    result = go() if uid is None else as_uid(uid, go)
    assert "exception" not in result, result
    out = result["out"]
    return result["final"], {int(k): v for k, v in out["1"].items()}, {int(k): v for k, v in out["2"].items()}


def submit(cluster, argv, nranks, *, env, cwd) -> int:
    async def main():
        async with connect(cluster.dir) as gang:
            return (await gang.submit([str(a) for a in argv], nranks, env=env, cwd=str(cwd)))["id"]

    return trio.run(main)


def probes(cluster, argv, nranks=1, **kwargs) -> list[dict]:
    final, out, err = run(cluster, argv, nranks, **kwargs)
    assert final["state"] == "DONE", (final, err)
    return [json.loads(out[r]) for r in range(nranks)]


def until_served(cluster, argv, nranks=1, tries=200, **kwargs) -> list[dict]:
    """Run the probe until a run had every rank served (the first run of a key
    starts its server in the background and is exec'd)."""
    for _ in range(tries):
        seen = probes(cluster, argv, nranks, **kwargs)
        if all(p["served"] for p in seen):
            return seen
        time.sleep(0.3)
    raise AssertionError(f"no run of {argv} was served in {tries} tries")


def comparable(probe: dict) -> dict:
    """A probe without what differs between any two ranks (ids, pids, random draws)."""
    skip = {"served", "random", "nprandom", "pid", "ppid"}
    found = {k: v for k, v in probe.items() if k not in skip}
    per_rank = ("GANGD_JOB", "GANGD_RANK")
    job = probe["env"]["GANGD_JOB"]
    found["spec"] = re.sub(r" at 0x[0-9a-f]+", "", probe["spec"])
    found["env"] = {k: v.replace(f"job-{job}", "job-N") for k, v in probe["env"].items() if k not in per_rank}
    found["proc_env"] = [e.replace(f"job-{job}", "job-N") for e in probe["proc_env"] if e.split("=", 1)[0] not in per_rank]
    found["cgroup"] = "\n".join(line for line in probe["cgroup"].splitlines() if "job-" not in line)
    found["job_cgroups"] = sorted(line.split(":", 2)[1] for line in probe["cgroup"].splitlines() if "/job-" in line and "/rank-" in line)
    return found


def servers(uid: int | None = None, daemon: int | None = None) -> list[psutil.Process]:
    """Live rank servers (of ``uid``, of the daemon ``daemon``)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "uids", "ppid", "status"]):
        cmdline = proc.info["cmdline"] or []
        if (any(part.endswith("rankserver_main.py") for part in cmdline) and (uid is None or proc.info["uids"].real == uid)
                and (daemon is None or proc.info["ppid"] == daemon) and proc.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(proc)
    return found


# ---------------------------------------------------------------- sameness


@pytest.mark.parametrize("how", ["script", "relative", "module"])
def test_a_served_rank_sees_what_an_exec_d_rank_sees(cluster, place, how):
    argv = {"script": [sys.executable, place / "probe.py", "a b", "--x"], "relative": [sys.executable, "probe.py", "a b", "--x"],
            "module": [sys.executable, "-m", "probe", "a b", "--x"]}[how]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "SOME_VAR": "v", "PYTHONGANGDTEST": how}
    first = probes(cluster, argv, 2, env=env, cwd=place)
    assert not first[0]["served"]  # a new key: its server starts behind this job, which is exec'd
    served = until_served(cluster, argv, 2, env=env, cwd=place)
    for exec_d, forked in zip(first, served, strict=True):
        assert comparable(forked) == comparable(exec_d)
    probe = served[0]
    assert probe["threads"] == 1 and probe["fds"] == ["0", "1", "2", "3"]  # (3: the listing's own)
    assert comparable(probe)["job_cgroups"]  # in its rank's cgroup (and the comparison: the same hierarchies as exec'd)
    assert probe["argv"][1:] == ["a b", "--x"] and probe["name"] == "__main__"


def test_ranks_draw_different_random_numbers(cluster, place):
    argv = [sys.executable, place / "probe.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "random"}
    seen = until_served(cluster, argv, 3, env=env, cwd=place)
    assert len({p["random"] for p in seen}) == 3
    assert None not in {p["nprandom"] for p in seen} and len({p["nprandom"] for p in seen}) == 3


def strip(status: dict) -> dict:
    return {k: v for k, v in status.items() if k not in ("cpu", "node")}


def test_exit_codes_signals_and_tracebacks_as_exec_d(cluster, place):
    (place / "ends.py").write_text(textwrap.dedent('''\
        import os, signal, sys
        how = os.environ["HOW"]
        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read()
        with open(os.path.join(os.path.dirname(__file__), f"ends-{how}.log"), "a") as log:
            log.write("served\\n" if b"rankserver_main.py" in parent else "exec\\n")
        if how == "code":
            sys.exit(7)
        if how == "message":
            sys.exit("bad input")
        if how == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        if how == "raise":
            def inner():
                raise ValueError("oops")
            inner()
        if how == "atexit":
            import atexit
            atexit.register(lambda: print("at exit", flush=True))
            print("body")
        '''))
    argv = [sys.executable, place / "ends.py"]
    results: dict = {}
    for how in ("code", "message", "signal", "raise", "atexit"):
        env = {"PATH": "/usr/bin:/bin", "HOW": how, "PYTHONGANGDTEST": how}
        for _ in range(200):
            final, out, err = run(cluster, argv, 1, env=env, cwd=place)
            results.setdefault(how, []).append((final["state"], strip(final["ranks"][0]),
                                                out.get(0, ""), err.get(0, "")))
            if "served" in (place / f"ends-{how}.log").read_text().split():
                break
            time.sleep(0.3)
        assert (place / f"ends-{how}.log").read_text().split()[0] == "exec"
        assert "served" in (place / f"ends-{how}.log").read_text().split()
    for how, runs in results.items():
        # The first run of a key is exec'd, the last one served: alike.
        assert runs[-1] == runs[0], (how, runs)
    assert results["code"][0][1] == {"code": 7}
    assert results["message"][0][1] == {"code": 1} and results["message"][0][3] == "bad input\n"
    assert results["signal"][0][1] == {"signal": signal.SIGTERM}
    assert results["raise"][0][1] == {"code": 1}
    traceback = results["raise"][0][3]
    assert "rankserver" not in traceback and "ValueError: oops" in traceback and "in inner" in traceback
    assert results["atexit"][0][2] == "body\nat exit\n"


def test_served_ranks_leave_no_fds_in_the_daemon(cluster, place):
    argv = [sys.executable, place / "probe.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "fds"}
    until_served(cluster, argv, 2, env=env, cwd=place)
    daemon = psutil.Process(cluster.daemon_pid("n1"))
    time.sleep(0.5)
    before = daemon.num_fds()
    for _ in range(5):
        assert all(p["served"] for p in probes(cluster, argv, 2, env=env, cwd=place))
    time.sleep(0.5)
    assert daemon.num_fds() <= before + 2, (before, daemon.num_fds())


def test_a_served_ranks_cpu_time_is_accounted(cluster, place):
    (place / "burn.py").write_text(textwrap.dedent('''\
        import os, time
        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read()
        end = time.process_time() + 0.5
        while time.process_time() < end:
            pass
        print(b"rankserver_main.py" in parent)
        '''))
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "burn"}
    for _ in range(200):
        final, out, _ = run(cluster, [sys.executable, place / "burn.py"], 1, env=env, cwd=place)
        if out[0].strip() == "True":
            break
        time.sleep(0.3)
    else:
        raise AssertionError("never served")
    assert final["ranks"][0]["cpu"] >= 0.45, final["ranks"]


def test_killing_the_job_kills_its_served_ranks(cluster, place):
    argv = [sys.executable, place / "probe.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "kill"}
    until_served(cluster, argv, 1, env=env, cwd=place)
    job = submit(cluster, argv, 2, env={**env, "PROBE_SLEEP": "300"}, cwd=place)
    cluster.wait_state(job, "RUNNING")
    deadline = time.monotonic() + 30
    pids = []
    while time.monotonic() < deadline and len(pids) < 2:
        pids = list(cluster.rank_processes(job))
        time.sleep(0.1)
    assert len(pids) == 2, "the served ranks show the job's environment in /proc/PID/environ"
    assert all(any(part.endswith("rankserver_main.py") for part in p.parent().cmdline()) for p in pids)
    cluster.gang("kill", job, check=True)
    record = cluster.wait_state(job, "KILLED")
    _, alive = psutil.wait_procs(pids, timeout=10)
    assert not alive
    assert all(r and r.get("killed") for r in record["ranks"]), record["ranks"]


def test_a_script_beside_its_own_copy_of_a_preloaded_module_gets_its_own(cluster, place):
    """The server imported json; a script whose directory has a json.py of
    its own imports that one when exec'd, so it must never be forked."""
    directory = place / "shadow"
    directory.mkdir(mode=0o755)
    (directory / "json.py").write_text("MARK = 'mine'\n")
    (directory / "main.py").write_text("import json\nprint(getattr(json, 'MARK', 'stdlib'))\n")
    argv = [sys.executable, directory / "main.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "shadow"}
    until_served(cluster, [sys.executable, place / "probe.py"], 1, env=env, cwd=place)  # (the key's server is warm)
    for _ in range(3):
        _, out, err = run(cluster, argv, 1, env=env, cwd=place)
        assert out[0] == "mine\n", (out, err)


def test_a_zip_application_runs_its_main_as_python_would(cluster, place):
    """``python app.pyz`` of a zip application (a shebang line, then the zip) runs the zip's __main__.py:
    never the file's bytes as a script. The server refuses it (its end record is in the file's tail), and
    the rank is exec'd."""
    directory = place / "zipapp"
    directory.mkdir(mode=0o755)
    source = directory / "src"
    source.mkdir(mode=0o755)
    (source / "__main__.py").write_text("import sys\nprint('zip main', sys.argv[1:])\n")
    app = directory / "app.pyz"
    zipapp.create_archive(source, app, interpreter="/usr/bin/env python3")
    app.chmod(0o644)
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "zipapp"}
    until_served(cluster, [sys.executable, place / "probe.py"], 1, env=env, cwd=place)  # (the key's server is warm)
    _, out, err = run(cluster, [sys.executable, app, "x"], 1, env=env, cwd=place)
    assert out[0] == "zip main ['x']\n", (out, err)


def test_a_module_changed_on_disk_is_never_served_stale(cluster, place):
    """A server imported its modules once; a rank after an upgrade on disk
    must get the new one (the child declines, the server is replaced)."""
    lib = place / "lib"
    (lib / "numpy").mkdir(parents=True)
    (lib / "numpy" / "random.py").write_text("import random as _r\n\ndef seed():\n    pass\n\ndef random():\n    return _r.random()\n")
    init = lib / "numpy" / "__init__.py"
    init.write_text("from . import random\nVERSION = 1\n")
    (place / "version.py").write_text("import os, numpy\n"
                                      "parent = open(f'/proc/{os.getppid()}/cmdline', 'rb').read()\n"
                                      "print(numpy.VERSION, b'rankserver_main.py' in parent)\n")
    argv = [sys.executable, place / "version.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(lib), "PYTHONGANGDTEST": "stale"}

    def version() -> tuple[str, bool]:
        final, out, err = run(cluster, argv, 1, env=env, cwd=place)
        assert final["state"] == "DONE", err
        number, served = out[0].split()
        return number, served == "True"

    for _ in range(200):
        if version() == ("1", True):
            break
        time.sleep(0.3)
    else:
        raise AssertionError("never served")
    init.write_text("from . import random\nVERSION = 2\n")
    os.utime(init, ns=(time.time_ns(), time.time_ns() + 10**9))
    seen = []
    for _ in range(200):
        seen.append(version())
        if seen[-1][1]:
            break
        time.sleep(0.3)
    assert all(number == "2" for number, _ in seen), seen
    assert seen[-1] == ("2", True)  # (a new server, which imported the new one)


# ---------------------------------------------------------------- users


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a second uid")
def test_a_stranger_never_uses_another_users_server(cluster, place):
    argv = [SYSTEM_PYTHON, place / "probe.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "stranger"}  # the same interpreter and key variables for both users
    roots = until_served(cluster, argv, 1, env=env, cwd=place)
    assert roots[0]["ids"][:4] == [0, 0, 0, 0]
    first = probes(cluster, argv, 1, env=env, cwd=place, uid=NOBODY)
    assert not first[0]["served"], "nobody's first rank was forked by root's server"
    theirs = until_served(cluster, argv, 1, env=env, cwd=place, uid=NOBODY)
    assert theirs[0]["ids"] == [NOBODY, NOBODY, NOBODY, NOBODY, [NOBODY]]
    assert comparable(theirs[0]) == comparable(first[0])
    assert servers(NOBODY) and all(proc.uids().real == NOBODY and proc.uids().effective == NOBODY for proc in servers(NOBODY))


# ---------------------------------------------------------------- failing servers


def test_jobs_launch_when_the_server_is_killed_or_hung(cluster, place):
    argv = [sys.executable, place / "probe.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": "failing"}
    until_served(cluster, argv, 1, env=env, cwd=place)
    # A served rank dies with its server (PDEATHSIG), reported as killed by SIGKILL.
    job = submit(cluster, argv, 1, env={**env, "PROBE_SLEEP": "300"}, cwd=place)
    cluster.wait_state(job, "RUNNING")
    deadline = time.monotonic() + 30
    while not (ranks := cluster.rank_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.1)
    server = ranks[0].parent()
    assert any(part.endswith("rankserver_main.py") for part in server.cmdline())
    server.send_signal(signal.SIGKILL)
    record = cluster.wait_state(job, {"FAILED", "KILLED", "DONE"})
    assert record["ranks"][0]["signal"] == signal.SIGKILL, record["ranks"]
    # With the server gone, the next job runs (exec'd), and a new server comes.
    assert not probes(cluster, argv, 1, env=env, cwd=place)[0]["served"]
    fresh = until_served(cluster, argv, 1, env=env, cwd=place)[0]["ppid"]
    # A hung server: the request times out, the server is killed, the rank is exec'd.
    hung = [psutil.Process(fresh)]
    for proc in hung:
        proc.send_signal(signal.SIGSTOP)
    try:
        seen = probes(cluster, argv, 2, env=env, cwd=place, timeout=120)
        assert not any(p["served"] for p in seen)
    finally:
        for proc in hung:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
    for proc in hung:
        try:
            proc.wait(timeout=10)
        except psutil.NoSuchProcess:
            pass
    assert not any(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE for proc in hung)
    cluster.wait_no_rank_processes()


HOSTILE = textwrap.dedent('''\
    """A "python3" that is a hostile rank server when the daemon starts it as one."""
    import json, os, socket, sys
    if not sys.argv[1].endswith("rankserver_main.py"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3", *sys.argv[1:]])
    sock = socket.socket(fileno=int(sys.argv[2]))
    sock.send(json.dumps({"hello": 1, "pid": os.getpid()}).encode())
    victim = int(open(os.path.join(os.path.dirname(__file__), "victim")).read())
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
        if not data:
            break
        sock.send(json.dumps({"pid": victim}).encode())
''')


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a second uid")
@pytest.mark.parametrize("victim_uid", [0, NOBODY])
def test_a_hostile_server_cannot_make_the_daemon_touch_another_process(cluster, place, victim_uid):
    """nobody's "python3" is a server that names a process that is not its
    child (root's, or nobody's own): the daemon neither signals it nor moves
    it into the job's cgroup, kills the server, and the job runs (exec'd)."""
    directory = place / f"hostile-{victim_uid}"
    directory.mkdir(mode=0o755)
    (directory / "python3").write_text(f"#!{SYSTEM_PYTHON}\n" + HOSTILE)
    (directory / "python3").chmod(0o755)
    victim = subprocess.Popen(["sleep", "300"], user=victim_uid, start_new_session=True)
    try:
        (directory / "victim").write_text(str(victim.pid))
        cgroups_before = Path(f"/proc/{victim.pid}/cgroup").read_text()
        argv = [directory / "python3", place / "probe.py"]
        env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": f"hostile-{victim_uid}"}
        for _ in range(6):  # the first starts the server; later ones ask it
            seen = probes(cluster, argv, 1, env=env, cwd=place, uid=NOBODY)
            assert not seen[0]["served"] and seen[0]["ids"][0] == NOBODY
            assert victim.poll() is None, "the daemon signalled the process a hostile server named"
            assert Path(f"/proc/{victim.pid}/cgroup").read_text() == cgroups_before
            time.sleep(0.3)
        assert "is not the server's child" in cluster.log("n1")
    finally:
        victim.kill()
        victim.wait()


LIAR = textwrap.dedent('''\
    """A "python3" that serves ranks by the protocol, then lies about how they ended."""
    import json, os, socket, sys
    if not sys.argv[1].endswith("rankserver_main.py"):
        os.execv("/usr/bin/python3", ["/usr/bin/python3", *sys.argv[1:]])
    sock = socket.socket(fileno=int(sys.argv[2]))
    sock.send(json.dumps({"hello": 1, "pid": os.getpid()}).encode())
    lie = open(os.path.join(os.path.dirname(__file__), "lie")).read().encode()
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 16)
        if not data:
            break
        request = json.loads(data)
        stdout, stderr, ready_w, go_r, status_w = fds
        pid = os.fork()
        if pid == 0:
            os.setsid()
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            os.write(ready_w, b"R")
            os.read(go_r, 1)
            os.chdir(request["cwd"])
            os.execve("/usr/bin/python3", ["/usr/bin/python3", *request["argv"][1:]], request["env"])
        for fd in (stdout, stderr, ready_w, go_r):
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
        os.waitpid(pid, 0)
        os.write(status_w, lie)
        os.close(status_w)
''')


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to a second uid")
@pytest.mark.parametrize("lie", ["99999999999999999999999999", "-5", "4991", "zero"])
def test_a_servers_word_on_how_a_rank_ended_is_checked(cluster, place, lie):
    """A server that reports an impossible status (too large, negative, a
    stop, garbage): the rank is reported as killed by SIGKILL, its status
    lost, and the daemon goes on."""
    directory = place / ("liar" + re.sub(r"\W", "_", lie))
    directory.mkdir(mode=0o755)
    (directory / "python3").write_text(f"#!{SYSTEM_PYTHON}\n" + LIAR)
    (directory / "python3").chmod(0o755)
    (directory / "lie").write_text(lie)
    argv = [directory / "python3", place / "probe.py"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONGANGDTEST": f"liar-{lie}"}
    for _ in range(200):
        final, out, _ = run(cluster, argv, 1, env=env, cwd=place, uid=NOBODY)
        if final["ranks"][0].get("code") != 0:
            break
        assert not json.loads(out[0])["served"]  # (exec'd while the server starts)
        time.sleep(0.3)
    assert strip(final["ranks"][0]) == {"signal": signal.SIGKILL, "why": "its exit status was lost: its rank server died (and the rank with it)"}
    assert json.loads(out[0])["served"] and json.loads(out[0])["ids"][0] == NOBODY


def test_off_by_default(make_cluster, place):
    plain = make_cluster(1)
    argv = [sys.executable, place / "probe.py"]
    for _ in range(3):
        assert not probes(plain, argv, 1, cwd=place)[0]["served"]
        time.sleep(0.3)
    assert not servers(daemon=plain.daemon_pid("n1"))


INIT_PROBE = textwrap.dedent('''\
    """What ckpt.init() and a checkpoint's state format import in a rank (a restart's path)."""
    import json, os, sys
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\\0")
    before = set(sys.modules)
    import numpy as np
    from gangd import ckptlib as ckpt
    ckpt.init()
    ckpt.protect("u", lambda: np.zeros(16))
    from gangd.checkpoint import messages  # (what a restore parses the daemon's chain with)
    from gangd.ckptlib import blocks, units  # (what restoring a generation reads it with)
    print(json.dumps({"served": any(part.endswith(b"rankserver_main.py") for part in parent),
                      "imported": sorted(set(sys.modules) - before)}), flush=True)
    ckpt.fini()
''')


def test_a_served_rank_finds_the_checkpoint_library_loaded(cluster, place):
    """A served rank is there to skip Python's imports: ckptlib's ``init()``
    under a job (the daemon agent, its messages, the pacer) and the block
    format a restore reads must already be in the server, or every rank of
    every restart pays 0.1-0.15 s for them after the fork (bench/restart.py).
    An exec'd rank imports them all: the probe sees the difference."""
    (place / "init_probe.py").write_text(INIT_PROBE)
    (place / "init_probe.py").chmod(0o644)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p.endswith("src"))}
    argv = [sys.executable, place / "init_probe.py"]
    for _ in range(200):
        final, out, err = run(cluster, argv, 1, env=env, cwd=place)
        assert final["state"] == "DONE", (final, err)
        seen = json.loads(out[0])
        if seen["served"]:
            break
        exec_d = set(seen["imported"])
        assert {"gangd.ckptlib.agent", "gangd.checkpoint.messages", "gangd.ckptlib.blocks"} <= exec_d, sorted(m for m in exec_d if "gangd" in m)
        time.sleep(0.3)
    else:
        raise AssertionError("no run of the probe was served")
    assert not [m for m in seen["imported"] if m.startswith(("gangd", "numpy"))], seen["imported"]
