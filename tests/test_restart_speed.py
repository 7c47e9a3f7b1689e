"""What makes a restart quick, and what a user relies on while it is.

The contract (issue 16, "Restart speed"):

* ``ckpt.protect(name, factory)`` calls the factory on a fresh start only:
  on a restart the saved value comes back and the factory is never called
  (a factory that writes a marker file shows it) — alone and under gangd.
* What comes back is bit-identical (the run ends with the digest of an
  uninterrupted one) and writable in place.
* An array given directly whose dtype or shape differs from the saved one
  (a program restarted with other parameters) is refused with a sentence
  naming both; a checkpoint file that is truncated, grown or has a header
  pointing outside it is refused with the file's name.

Real processes, real files, real SIGKILL; the gangd test runs real daemons.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
from ckpthelpers import checkpoint, hold, kill_and_restart, kill_what_is_left, result_of, submit, wait_holding
from conftest import as_uid, shared_cluster

from gangd import ckptstore
from gangd.ckptlib import image
from gangd.ckptstore import StoreError
from gangd.client import oneshot
from gangd.daemon import ranks
from gangd.errors import RemoteError
from gangd.protocol import Connection, Request, Role

PROGRAM = textwrap.dedent(
    """
    import hashlib, os, signal, sys
    import numpy as np
    from gangd import ckptlib as ckpt

    N = 40
    LEN = int(os.environ.get("T_LEN", "4096"))
    DTYPE = os.environ.get("T_DTYPE", "float64")
    MARKER = os.environ["T_MARKER"]
    FORM = os.environ.get("T_FORM", "factory")
    REQUEST_AT, KILL_AT = int(os.environ.get("T_REQUEST", "-1")), int(os.environ.get("T_KILL", "-1"))

    def build():
        with open(MARKER, "a") as fh:
            fh.write("built\\n")
        return (np.arange(LEN) % 97).astype(DTYPE).reshape(-1, 64)

    ckpt.init()
    if FORM == "factory":
        u = ckpt.protect("u", build)
    else:
        u = ckpt.protect("u", build())
    state = ckpt.protect("state", lambda: {"total": 0})
    print("restarted", ckpt.restarted(), u.dtype, u.shape, u.flags.writeable, u.flags.aligned, flush=True)
    for it in ckpt.loop(range(N)):
        u *= 1.0001
        u[it % u.shape[0]] += it
        state["total"] += it
        if it == REQUEST_AT:
            ckpt.request()
        if it == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.fini()
    print("digest", hashlib.sha256(u.tobytes() + repr(state).encode()).hexdigest(), flush=True)
    """
)


def run(directory: Path, **env) -> subprocess.CompletedProcess:
    script = directory / "prog.py"
    if not script.exists():
        script.write_text(PROGRAM)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GANGD_")}
    clean.update({"T_MARKER": str(directory / "built"), **{k: str(v) for k, v in env.items()}})
    return subprocess.run([sys.executable, str(script)], cwd=directory, env=clean, capture_output=True, text=True, timeout=60, check=False)


def line(result: subprocess.CompletedProcess, key: str) -> list[str]:
    for text in result.stdout.splitlines():
        if text.split()[:1] == [key]:
            return text.split()[1:]
    raise AssertionError(f"no {key!r} line (exit {result.returncode}):\n{result.stdout}\n--- stderr:\n{result.stderr}")


def builds(directory: Path) -> int:
    marker = directory / "built"
    return len(marker.read_text().splitlines()) if marker.exists() else 0


def state_file(directory: Path, gen: int = 1) -> Path:
    return ckptstore.gen_dir(directory / "prog.ckpt", 0, gen) / ckptstore.rank_file(0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = run(directory)
    assert result.returncode == 0, result.stderr
    return line(result, "digest")[0]


def checkpointed_and_killed(directory: Path, **env) -> None:
    killed = run(directory, T_REQUEST=10, T_KILL=20, **env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert state_file(directory).exists()


# ---------------------------------------------------------------- the factory


@pytest.mark.parametrize("form", ["factory", "value"])
def test_factory_is_called_on_a_fresh_start_only_and_the_state_comes_back_bit_identical(tmp_path, uninterrupted, form):
    checkpointed_and_killed(tmp_path, T_FORM=form)
    assert builds(tmp_path) == 1

    resumed = run(tmp_path, GANGD_RESTART="latest", T_FORM=form)
    assert resumed.returncode == 0, resumed.stderr
    # The factory form skips building what the restart replaces; the value form builds it (and throws it away).
    assert builds(tmp_path) == (1 if form == "factory" else 2)
    assert line(resumed, "restarted") == ["True", "float64", "(64,", "64)", "True", "True"]  # writable, aligned
    assert line(resumed, "digest") == [uninterrupted]


def test_a_fresh_start_with_restart_auto_and_no_checkpoint_calls_the_factory(tmp_path, uninterrupted):
    result = run(tmp_path, GANGD_RESTART="auto")
    assert result.returncode == 0, result.stderr
    assert line(result, "restarted")[0] == "False"
    assert builds(tmp_path) == 1
    assert line(result, "digest") == [uninterrupted]


# ---------------------------------------------------------------- mismatches


@pytest.mark.parametrize(("env", "given"), [
    ({"T_LEN": "2048"}, "a float64 array of shape (32, 64)"),
    ({"T_DTYPE": "float32"}, "a float32 array of shape (64, 64)"),
])
def test_an_array_of_another_dtype_or_shape_is_refused_on_restart(tmp_path, env, given):
    checkpointed_and_killed(tmp_path, T_FORM="value")
    refused = run(tmp_path, GANGD_RESTART="latest", T_FORM="value", **env)
    assert refused.returncode != 0
    assert "digest" not in refused.stdout
    assert f"protect('u'): the checkpoint holds a float64 array of shape (64, 64), the program gives {given}" in refused.stderr, refused.stderr


# ---------------------------------------------------------------- hostile files


def rewrite_manifest_size(directory: Path, size_of: Path) -> None:
    """The manifest made to agree with a file's new size (and checksum): only the content can tell."""
    gen = size_of.parent
    manifest = ckptstore.read_manifest(gen)
    manifest.files[size_of.name] = list(ckptstore.checksum_file(size_of))
    ckptstore.write_manifest(gen, manifest)


@pytest.mark.parametrize("damage", ["truncated", "grown"])
def test_a_state_file_of_the_wrong_size_is_refused_naming_it(tmp_path, damage):
    checkpointed_and_killed(tmp_path)
    path = state_file(tmp_path)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        if damage == "truncated":
            fh.truncate(size - 100)
        else:
            fh.seek(0, os.SEEK_END)
            fh.write(b"\0" * 4096)
    refused = run(tmp_path, GANGD_RESTART="1")
    assert refused.returncode != 0
    assert f"{path.relative_to(tmp_path)} is truncated or grew" in refused.stderr, refused.stderr  # (alone: the path as the program names it)
    assert builds(tmp_path) == 1  # (nor was the state built instead)


@pytest.mark.parametrize("damage", ["truncated", "grown"])
def test_a_state_file_whose_manifest_agrees_but_whose_content_does_not_add_up_is_refused(tmp_path, damage):
    """Size and checksum made consistent by hand (the manifest is the
    owner's): the file itself must still hold what its header says."""
    checkpointed_and_killed(tmp_path)
    path = state_file(tmp_path)
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        if damage == "truncated":
            fh.truncate(size - 8 * 64)  # inside the array
        else:
            fh.seek(0, os.SEEK_END)
            fh.write(b"x" * 100)
    rewrite_manifest_size(tmp_path, path)
    refused = run(tmp_path, GANGD_RESTART="1")
    assert refused.returncode != 0
    assert str(path.relative_to(tmp_path)) in refused.stderr and ("truncated" in refused.stderr or "trailing bytes" in refused.stderr), refused.stderr


def test_arrays_come_back_writable_aligned_and_independent_of_the_file(tmp_path):
    path = tmp_path / "rank-0.state"
    big = np.random.default_rng(3).random((512, 1024))  # 4 MiB
    small = np.arange(10, dtype=np.int16)
    size, digest = image.save(path, {"small": small, "big": big, "d": {"k": 1}}, 3)
    values, iteration, _ = image.load(path, (size, digest))
    assert iteration == 3 and list(values) == ["small", "big", "d"]
    assert values["big"].tobytes() == big.tobytes() and values["small"].tobytes() == small.tobytes()
    for arr in (values["big"], values["small"]):
        assert arr.flags.writeable and arr.flags.aligned and arr.flags.c_contiguous
    values["big"] *= 2.0  # in place, and only in this process's copy
    values["small"][0] = 7
    again, _, _ = image.load(path, (size, digest))
    assert again["big"].tobytes() == big.tobytes() and again["small"][0] == 0
    assert ckptstore.checksum_file(path) == (size, digest)


def test_a_header_asking_for_object_pointers_is_refused(tmp_path):
    """Raw bytes never become object references (they would be pointers)."""
    header = msgpack.packb({"v": 1, "iteration": 0, "entries": [["a", "nd", {"dtype": "|O", "shape": [4]}, 32]], "extra": {}}, use_bin_type=True)
    path = tmp_path / "evil.state"
    path.write_bytes(image.MAGIC + len(header).to_bytes(8, "little") + header + b"\x41" * 32)
    with pytest.raises(StoreError, match="corrupted"):
        image.load(path)


def test_image_load_refuses_headers_that_point_outside_the_file(tmp_path):
    path = tmp_path / "rank-0.state"
    size, digest = image.save(path, {"a": np.arange(200_000, dtype=np.float64)}, 3)
    data = path.read_bytes()
    with open(path, "wb") as fh:
        fh.write(data[: size // 2])
    with pytest.raises(StoreError, match="truncated"):
        image.load(path)
    with pytest.raises(StoreError, match="truncated or grew"):
        image.load(path, (size, digest))


# ---------------------------------------------------------------- under gangd

RING = textwrap.dedent(
    """
    import hashlib, os, sys, time
    import numpy as np
    from gangd import ckptlib as ckpt, comm

    marker_dir, steps = sys.argv[1], int(sys.argv[2])
    release = sys.argv[3] if len(sys.argv) > 3 else None  # (idle at step 30 until this file exists: ckptjob's hold)
    ckpt.init()
    w = comm.world()

    def build():
        with open(os.path.join(marker_dir, f"built-{w.rank}-{os.getpid()}"), "w"):
            pass
        return np.random.default_rng(w.rank).random(1 << 17)

    u = ckpt.protect("u", build)
    info = ckpt.protect("info", {"step": 0, "released": release is None})
    if ckpt.restarted():  # where the restored array lives: a mapping of the generation's file, or anonymous memory
        address = u.__array_interface__["data"][0]
        with open("/proc/self/maps") as maps:
            for entry in maps:
                span, *rest = entry.split()
                low, high = (int(x, 16) for x in span.split("-"))
                if low <= address < high:
                    with open(os.path.join(marker_dir, f"restored-{w.rank}-" + (os.path.basename(rest[4]) if len(rest) > 4 else "anonymous")), "w"):
                        pass

    def items():  # one per step and one per idle iteration of the hold, as ckptjob's
        k = 0
        while info["step"] < steps:
            yield k
            k += 1

    holding = False
    for _ in ckpt.loop(items()):
        if info["step"] == 30 and not info["released"]:  # (no message is sent in the hold)
            if not holding:
                print(f"rank {w.rank} holding at step 30", flush=True)
                holding = True
            if os.path.exists(release):
                info["released"] = True
            else:
                time.sleep(0.01)
            continue
        it = info["step"]
        info["step"] += 1
        u[it % u.size] += 1.0
        w.send(np.array([u.sum()]), (w.rank + 1) % w.size)
        u[0] += w.recv(source=(w.rank - 1) % w.size)[0] * 1e-9
        time.sleep(0.02)
    ckpt.fini()
    mine = np.frombuffer(hashlib.sha256(u.tobytes()).digest(), dtype=np.uint8)
    if w.rank:
        w.send(mine, 0)
    else:
        others = [bytes(w.recv(source=r)).hex() for r in range(1, w.size)]
        print("RESULT", bytes(mine).hex(), *others, flush=True)
    """
)


@pytest.fixture(scope="module")
def gc():
    with shared_cluster(2, cores=2, time_slice=0.1, max_slots=2) as cluster:
        yield cluster


def test_under_gangd_a_restart_never_calls_the_factory_and_ends_bit_identical(gc, tmp_path):
    tmp_path.chmod(0o777)
    program = tmp_path / "ring.py"
    program.write_text(RING)
    program.chmod(0o644)
    fresh, first, second = (tmp_path / name for name in ("fresh", "first", "second"))
    for directory in (fresh, first, second):
        directory.mkdir(mode=0o777)
    try:
        expected = result_of(gc, submit(gc, [str(program), str(fresh), "150"], 2), timeout=120)
        _, release = hold(gc, 30)  # (the checkpoint lands at the hold, however loaded the machine: not after the job ended)
        job = submit(gc, [str(program), str(first), "150", str(release)], 2)
        wait_holding(gc, job)
        gen = checkpoint(gc, job)
        assert gen["state"] in ("complete", "protected"), gen
        release.touch()
        restarted = kill_and_restart(gc, job)
        # (the argv is the checkpointed job's: the restart's builds would land in first/ too)
        assert result_of(gc, restarted, timeout=120) == expected
        assert len(list(fresh.iterdir())) == 2
        assert len(list(first.glob("built-*"))) == 2  # one build per rank, by the first run only
        # Each restarted rank's array (1 MiB) is a copy-on-write mapping of its state file, not a copy of it.
        assert sorted(p.name for p in first.glob("restored-*")) == ["restored-0-rank-0.state", "restored-1-rank-1.state"]
        assert not list(second.iterdir())
    finally:
        kill_what_is_left(gc)


# ---------------------------------------------------------------- `gang restart`: one request, no trio

# The command as a user runs it, reporting on its way out whether it loaded trio
# (what costs a command ~0.13 s before its request: gangd.client.oneshot does without).
TRIO_REPORT = """
import atexit, sys
atexit.register(lambda: print("trio loaded:", "trio" in sys.modules, file=sys.stderr))
from gangd.client.cli import main
sys.argv[0] = "gang"
main()
"""


def gang_cmd(cluster_dir, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRIO_REPORT, "--cluster", str(cluster_dir), *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False, **kwargs)


def test_gang_restart_sends_its_request_without_loading_trio_and_says_what_the_daemon_answered(gc, tmp_path):
    tmp_path.chmod(0o777)
    program = tmp_path / "ring.py"
    program.write_text(RING)
    program.chmod(0o644)
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    try:
        missing = gang_cmd(gc.dir, "restart", 99999)
        assert (missing.returncode, missing.stderr.splitlines()) == (5, ["gang: no job 99999", "trio loaded: False"])
        _, release = hold(gc, 30)  # (the job still runs when it is refused and checkpointed, however loaded the machine)
        job = submit(gc, [str(program), str(out), "400", str(release)], 2)
        wait_holding(gc, job)
        running = gang_cmd(gc.dir, "restart", job)  # (a job that still runs is refused: kill it first)
        assert running.returncode == 1 and f"gang kill {job}" in running.stderr and "trio loaded: False" in running.stderr, running.stderr
        assert checkpoint(gc, job)["state"] in ("complete", "protected")
        gc.gang("kill", job, check=True)
        release.touch()
        assert as_uid(65534, lambda: stranger_restarts(gc.dir, job)) == "permission_denied"  # (the daemon knows who asks from the socket)
        restarted = gang_cmd(gc.dir, "restart", "-q", job)
        assert restarted.returncode == 0, restarted.stderr
        assert restarted.stderr.splitlines() == ["trio loaded: False"]
        new = int(restarted.stdout)
        assert gc.job(new)["restart_of"]["job"] == job
    finally:
        kill_what_is_left(gc)


def test_the_commands_that_only_ask_answer_without_loading_trio_and_the_streaming_ones_still_follow(gc):
    """submit, ps, job, nodes, history, suspend, resume, net, checkpoint,
    ckpt ls and kill send requests and print answers: they run over
    gangd.client.oneshot's blocking socket (half a command's CPU was
    importing trio), with the same output and exit codes; wait and logs
    follow streams and keep trio."""
    def ask(*args):
        result = gang_cmd(gc.dir, *args)
        lines = result.stderr.splitlines()
        assert lines[-1:] == ["trio loaded: False"], (args, result.stderr)
        return result.returncode, result.stdout, lines[:-1]

    try:
        code, out, _ = ask("submit", "-n", 2, "--name", "asked", "--", "sleep", "300")
        job = int(out)
        assert code == 0 and gc.wait_state(job, "RUNNING")["name"] == "asked"
        code, out, _ = ask("ps", "--all", "--json")
        assert code == 0 and [r["state"] for r in json.loads(out) if r["id"] == job] == ["RUNNING"]
        code, out, _ = ask("ps")
        assert code == 0 and out.splitlines()[0].split()[:2] == ["JOBID", "NAME"] and any(line.split()[:2] == [str(job), "asked"] for line in out.splitlines())
        code, out, _ = ask("job", job, "--json")
        assert code == 0 and json.loads(out)["id"] == job
        code, out, _ = ask("nodes", "--json")
        assert code == 0 and [n["name"] for n in json.loads(out)["nodes"]] == ["n1", "n2"]
        assert ask("suspend", job)[:2] == (0, f"job {job}: SUSPENDED\n")
        assert ask("resume", job)[:2] == (0, f"job {job}: RUNNING\n")
        code, out, _ = ask("net", job, "--json")
        assert code == 0 and isinstance(json.loads(out), dict)
        code, _, err = ask("checkpoint", job)  # (sleep takes no checkpoints: refused, with the daemon's reason)
        assert code == 1 and "does not take checkpoints" in err[0]
        code, out, _ = ask("ckpt", "ls", job)
        assert code == 0 and "no checkpoints" in out
        assert ask("kill", job)[:2] == (0, f"job {job}: KILLED\n")
        code, out, _ = ask("history", "--json")
        assert code == 0 and job in [r["id"] for r in json.loads(out)]
        assert ask("job", 99999)[0::2] == (5, ["gang: no job 99999"])
        # The streaming commands still work (through trio).
        waited = gang_cmd(gc.dir, "wait", job)
        assert waited.returncode == 137 and waited.stderr.splitlines()[-1] == "trio loaded: True", waited.stderr
    finally:
        kill_what_is_left(gc)


def stranger_restarts(cluster_dir: Path, job: int) -> str:
    try:
        oneshot.request(cluster_dir, "restart", job=job)
    except RemoteError as exc:
        return exc.code
    return "restarted"


def stderr_of(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}: {result.stdout}{result.stderr}"


def fake_daemon(path: Path, serve) -> threading.Thread:
    """A Unix socket that speaks the protocol for one connection as ``serve(sock, conn)`` says."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def run() -> None:
        with listener:
            sock, _ = listener.accept()
            with sock:
                conn = Connection(dialer=False, node="fake", accept=frozenset({Role.CLIENT}))
                serve(sock, conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def next_event(sock: socket.socket, conn: Connection):
    while (event := conn.next_event()) is None:
        data = sock.recv(65536)
        if not data:
            return None
        conn.receive_data(data)
    return event


def cluster_file(directory: Path, *sockets: Path) -> Path:
    directory.mkdir()
    (directory / "cluster.toml").write_text("".join(f'[[nodes]]\nsocket = "{s}"\n' for s in sockets))
    return directory


def test_gang_restart_tells_a_daemon_that_refused_or_dropped_it_from_one_that_is_not_there(tmp_path):
    def refuse(sock, conn):  # as a daemon beyond its limits does: a bye instead of its hello
        sock.sendall(conn.send_bye("too_many_connections", "uid 0 has 64 connections open"))
        sock.recv(4096)  # (the client's hello, taken before closing)

    def drop(sock, conn):
        assert next_event(sock, conn) is not None  # hello
        sock.sendall(conn.data_to_send())
        request = next_event(sock, conn)
        assert isinstance(request, Request) and request.op == "restart" and request.args["job"] == 7, request

    refusing, dropping, nobody = tmp_path / "refuse.sock", tmp_path / "drop.sock", tmp_path / "nobody.sock"
    threads = [fake_daemon(refusing, refuse), fake_daemon(dropping, drop)]
    # Refused: it is up and said why; the next node is not tried.
    refused = gang_cmd(cluster_file(tmp_path / "a", refusing, dropping), "restart", 7)
    assert refused.returncode == 1 and "refused the connection: uid 0 has 64 connections open" in refused.stderr, stderr_of(refused)
    # Nothing there, then a daemon that hangs up on the request: the request is not retried elsewhere.
    dropped = gang_cmd(cluster_file(tmp_path / "b", nobody, dropping), "restart", 7)
    assert dropped.returncode == 1 and "closed before 'restart' was answered" in dropped.stderr, stderr_of(dropped)
    # Nothing anywhere: exit 3, naming where it looked.
    absent = gang_cmd(cluster_file(tmp_path / "c", nobody), "restart", 7)
    assert absent.returncode == 3 and f"cannot reach a gangd daemon ({nobody}: " in absent.stderr, stderr_of(absent)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


# ---------------------------------------------------------------- one thread pool per rank's core

THREADS = "import os; print('threads', os.environ.get('OMP_NUM_THREADS'), os.environ.get('OPENBLAS_NUM_THREADS'))"


def test_a_rank_gets_one_blas_thread_per_core_unless_its_job_chose(gc):
    """numpy's OpenBLAS otherwise starts a thread per core of the machine in
    every rank (on cores other ranks own), spinning them up at import."""
    env = {k: v for k, v in os.environ.items() if k not in ranks.THREAD_VARS}
    default = gc.gang("run", "-n", "2", "--", sys.executable, "-c", THREADS, env=env)
    assert default.returncode == 0, default.stderr
    assert sorted(default.stdout.split("\n"))[-2:] == ["0: threads 1 None", "1: threads 1 None"], default.stdout
    chosen = gc.gang("run", "-n", "2", "--", sys.executable, "-c", THREADS, env={**env, "OPENBLAS_NUM_THREADS": "2"})
    assert chosen.returncode == 0, chosen.stderr
    assert sorted(chosen.stdout.split("\n"))[-2:] == ["0: threads None 2", "1: threads None 2"], chosen.stdout
