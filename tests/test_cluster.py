"""Real clusters, real daemons, real processes: what a user of `gang` relies on."""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest
import trio
from conftest import wait_for

from gangd.client.api import connect

PY = sys.executable


def test_cluster_comes_up_with_every_node(cluster4):
    rows = cluster4.gang_json("nodes")["nodes"]
    assert [r["name"] for r in rows] == ["n1", "n2", "n3", "n4"]
    assert all(r["state"] == "up" for r in rows)
    assert [r["address"].split(":")[0] for r in rows] == ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
    leader = [r["name"] for r in rows if r["coordinator"]]
    assert len(leader) == 1  # (the election's winner)
    # every daemon agrees: ask each node's own socket
    async def view_of(node):
        async with connect(sockets=[str(cluster4.files[node].socket)]) as gang:
            return gang.node, await gang.nodes()

    for node in ("n2", "n3", "n4"):
        answered_by, rows = trio.run(view_of, node)
        assert answered_by == node
        assert all(r["state"] == "up" for r in rows), (node, rows)
        assert [r["name"] for r in rows if r["coordinator"]] == leader, (node, rows)
        # Clock offsets, bounded by the heartbeats: these daemons share one
        # clock, which no bound can exclude, so each estimate is exactly 0.
        for r in rows:
            assert r["clock"]["offset"] == 0.0, (node, r)
            assert r["clock"]["error"] == 0.0 if r["name"] == node else r["clock"]["error"] > 0, (node, r)
    text = cluster4.gang("nodes", check=True).stdout
    assert f"{leader[0]}*" in text and "HEARTBEAT" in text
    assert "CLOCK" in text and "+0.00ms ±" in text, text


def test_eight_ranks_spread_over_four_nodes_and_all_output_arrives(cluster4):
    result = cluster4.gang("run", "-n", 8, "--", "sh", "-c", 'echo "rank=$GANGD_RANK size=$GANGD_SIZE node=$GANGD_NODE job=$GANGD_JOB"')
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 8
    seen = {}
    for line in lines:
        m = re.fullmatch(r"(\d+): rank=(\d+) size=8 node=(n\d) job=(\d+)", line)
        assert m, line
        assert m.group(1) == m.group(2)  # the label is the rank that printed it
        seen[int(m.group(2))] = m.group(3)
    assert seen == {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3", 5: "n3", 6: "n4", 7: "n4"}


def test_output_is_complete_and_in_order_per_rank(cluster4):
    script = "import sys\nfor i in range(3000):\n    print(f'line {i}')\n    (sys.stderr if i % 7 == 0 else sys.stdout)\n"
    result = cluster4.gang("run", "-n", 4, "--", PY, "-c", script)
    assert result.returncode == 0, result.stderr
    per_rank: dict[str, list[int]] = {}
    for line in result.stdout.splitlines():
        rank, text = line.split(": ", 1)
        per_rank.setdefault(rank, []).append(int(text.split()[1]))
    assert sorted(per_rank) == ["0", "1", "2", "3"]
    for rank, numbers in per_rank.items():
        assert numbers == list(range(3000)), f"rank {rank} output out of order or incomplete"


def test_stderr_goes_to_stderr_and_no_label_works(cluster4):
    result = cluster4.gang("run", "-n", 2, "--no-label", "--", "sh", "-c", "echo out; echo err >&2")
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["out", "out"]
    assert result.stderr.splitlines() == ["err", "err"]


def test_exit_code_is_the_worst_ranks(cluster4):
    result = cluster4.gang("run", "-n", 4, "--no-kill-on-bad-exit", "--", "sh", "-c", "exit $((GANGD_RANK * 10))")
    assert result.returncode == 30
    assert "FAILED" in result.stderr and "rank 3 on n4: exit 30" in result.stderr


def test_rank_killed_by_signal_is_reported_as_such(cluster4):
    # The other ranks sleep for an hour: only kill-on-bad-exit ends the run
    # within `gang`'s timeout here (it raises if the run outlives it).
    script = 'if [ "$GANGD_RANK" = 2 ]; then kill -SEGV $$; fi; sleep 3600'
    result = cluster4.gang("run", "-n", 4, "--", "sh", "-c", script, timeout=120)
    assert result.returncode == 128 + signal.SIGSEGV
    assert "rank 2 on n3: killed by SIGSEGV" in result.stderr
    # ... and the ranks gangd killed are not blamed for the failure
    assert "by gangd" not in result.stderr


def test_missing_program_fails_with_127_and_a_message(cluster4):
    result = cluster4.gang("run", "-n", 2, "--", "/nonexistent/program")
    assert result.returncode == 127
    assert "cannot start rank" in result.stderr and "/nonexistent/program" in result.stderr


def test_submit_ps_logs_wait(cluster4):
    job = int(cluster4.gang("submit", "-n", 3, "--name", "sweep", "--", "sh", "-c", "sleep 0.5; echo done $GANGD_RANK", check=True).stdout)
    rows = {r["id"]: r for r in cluster4.gang_json("ps")}
    assert rows[job]["name"] == "sweep" and rows[job]["nranks"] == 3 and rows[job]["owner"] == "root"
    assert rows[job]["state"] in ("QUEUED", "RUNNING", "DONE")
    follow = cluster4.gang("logs", "-f", job)
    assert sorted(follow.stdout.splitlines()) == ["0: done 0", "1: done 1", "2: done 2"]
    waited = cluster4.gang("wait", job)
    assert waited.returncode == 0
    record = cluster4.job(job)
    assert record["state"] == "DONE" and record["exit_code"] == 0
    only = cluster4.gang("logs", "--rank", 1, "--no-label", job)
    assert only.stdout == "done 1\n"
    text = cluster4.gang("ps", check=True).stdout
    assert re.search(rf"^{job}\s+sweep\s+root\s+3\s+n\[1-3\]\s+DONE", text, re.M), text


def test_too_large_job_is_refused_at_submit(cluster4):
    result = cluster4.gang("submit", "-n", 1000, "--", "true")
    assert result.returncode == 2
    assert "1000 ranks" in result.stderr and "at most 32" in result.stderr
    result = cluster4.gang("submit", "-n", 2, "-w", "n9", "--", "true")
    assert result.returncode == 2 and "unknown node 'n9'" in result.stderr


def test_unknown_job_gives_exit_5(cluster4):
    for cmd in (["kill", 9999], ["wait", 9999], ["logs", 9999]):
        result = cluster4.gang(*cmd)
        assert result.returncode == 5, (cmd, result.stderr)
        assert "no job 9999" in result.stderr


def test_kill_leaves_no_process_on_any_node(cluster4):
    # Each rank forks a background child and a setsid'd grandchild that escapes its process group.
    script = "sleep 300 & setsid sleep 300 & sleep 300"
    job = int(cluster4.gang("submit", "-n", 8, "--", "sh", "-c", script, check=True).stdout)
    cluster4.wait_state(job, "RUNNING")
    deadline = time.monotonic() + 10
    while len(cluster4.rank_processes(job)) < 8 * 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(cluster4.rank_processes(job)) == 32  # sh + 3 sleeps per rank
    result = cluster4.gang("kill", job)
    assert result.returncode == 0 and "KILLED" in result.stdout
    cluster4.wait_no_rank_processes(job)
    record = cluster4.wait_state(job, "KILLED")
    assert cluster4.gang("wait", job).returncode == 137
    assert "killed by root" in record["reason"]


def test_ctrl_c_on_gang_run_kills_the_whole_job(cluster4):
    proc = cluster4.popen_gang("run", "-n", 8, "--", "sleep", "300")
    job = _wait_for_running_job(cluster4, "sleep")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130, err
    assert f"killing job {job}" in err
    cluster4.wait_no_rank_processes(job)
    assert cluster4.wait_state(job, "KILLED")["state"] == "KILLED"


# SIGINT at its default, as a shell in a terminal starts a command: this process may run with SIGINT ignored
# (started in the background), which a child inherits, and Python then does not turn Ctrl-C into
# KeyboardInterrupt. Reset in an exec'ing wrapper rather than a preexec_fn (this process has threads).
DEFAULT_SIGINT = [PY, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"]


def _as_from_a_terminal(argv, **kwargs):
    """``argv`` (a `gang` command) started as from a terminal, once it is talking to a daemon (a Ctrl-C
    before that would land in Python's start-up, not in gang)."""
    import subprocess

    import psutil

    proc = subprocess.Popen([*DEFAULT_SIGINT, *map(str, argv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    child = psutil.Process(proc.pid)
    wait_for(lambda: proc.poll() is not None or child.net_connections(kind="unix"), 30, f"{argv[3:]} to connect to a daemon")
    return proc


def test_ctrl_c_on_gang_wait_stops_waiting_and_the_job_runs_on(cluster4):
    job = int(cluster4.gang("submit", "-n", 2, "--name", "waited", "--", "sleep", "300", check=True).stdout)
    try:
        cluster4.wait_state(job, "RUNNING")
        proc = _as_from_a_terminal([PY, "-m", "gangd.client.cli", "--cluster", cluster4.dir, "wait", job])
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert (proc.returncode, out, err) == (130, "", f"gang: interrupted: stopped waiting for job {job}; the job runs on\n")
        assert cluster4.job(job)["state"] == "RUNNING"  # as `gang wait --help` says
    finally:
        cluster4.gang("kill", job)


def test_ctrl_c_on_gang_run_as_from_a_terminal_kills_the_job_and_says_so_in_one_line(cluster4):
    proc = _as_from_a_terminal([PY, "-m", "gangd.client.cli", "--cluster", cluster4.dir, "run", "-n", 2, "--name", "run-tty", "--", "sleep", 300])
    job = _wait_for_running_job(cluster4, "run-tty")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert (proc.returncode, out) == (130, "")
    assert err.strip() == f"gang: SIGINT: killing job {job}", err
    assert cluster4.wait_state(job, "KILLED")["state"] == "KILLED"
    cluster4.wait_no_rank_processes(job)


@pytest.mark.parametrize("how", ["SIGHUP", "SIGKILL"])
def test_closing_the_terminal_kills_the_job(cluster4, how):
    proc = cluster4.popen_gang("run", "-n", 4, "--name", f"hup-{how}", "--", "sleep", "300")
    job = _wait_for_running_job(cluster4, f"hup-{how}")
    # SIGHUP is what a closed terminal sends; SIGKILL leaves no chance to clean
    # up, so the daemon notices the client's connection drop instead.
    proc.send_signal(getattr(signal, how))
    proc.communicate(timeout=20)
    cluster4.wait_no_rank_processes(job)
    assert cluster4.wait_state(job, "KILLED")["state"] == "KILLED"


def _wait_for_running_job(cluster, name: str) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for record in cluster.gang_json("ps"):
            if record["name"] == name and record["state"] == "RUNNING":
                return record["id"]
        time.sleep(0.1)
    raise AssertionError(f"no RUNNING job named {name}")


def test_help_has_examples_for_every_command():
    # Asked in this process of the group the `gang` script runs (its entry point, gangd.client.cli:main):
    # a Python started for each command took 35 s of a loaded run, for the same text.
    import click
    from click.testing import CliRunner

    from gangd.client.cli import main as cli_main

    def helped(*cmd: str) -> str:
        result = CliRunner().invoke(cli_main, [*cmd, "--help"], catch_exceptions=False)
        assert result.exit_code == 0, (cmd, result.output)
        return result.output

    def leaves(group: click.Group, path: list[str]):
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                yield from leaves(command, [*path, name])
            else:
                yield [*path, name]

    commands = list(leaves(cli_main, []))
    assert ["ckpt", "ls"] in commands and ["restart"] in commands and len(commands) >= 20, commands
    for cmd in commands:
        text = helped(*cmd)
        lines = [line.strip() for line in text.splitlines()]
        # Each example on a line of its own under "Examples:": click keeps an epilog's lines only after
        # its "\b" marker (the control character, not a backslash and a b, which it prints as text).
        assert "Examples:" in lines or "Example:" in lines, (cmd, text)
        assert "\\b" not in text and "\b" not in text, (cmd, text)
        assert any(line.startswith("gang " + " ".join(cmd)) for line in lines), (cmd, text)
    top = helped()
    assert "Exit codes" in top


def test_no_daemon_gives_exit_3(tmp_path):
    import subprocess

    from gangd.client.cluster import node_files  # noqa: F401  (import check)

    result = subprocess.run(
        [PY, "-m", "gangd.client.cli", "--cluster", str(tmp_path / "nothing"), "ps"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 3
    assert "no cluster in" in result.stderr


def test_ctrl_c_on_a_command_waiting_for_its_answer_is_one_line_and_130(tmp_path):
    """The commands that send one request over a blocking socket (ps, submit, kill, ...): Ctrl-C while the
    daemon has not answered yet (here one that accepted the connection and says nothing, as a stalled one)."""
    import os
    import socket

    silent = socket.socket(socket.AF_UNIX)
    silent.bind(str(tmp_path / "gangd.sock"))
    silent.listen()
    try:
        env = {k: v for k, v in os.environ.items() if k != "GANGD_CLUSTER"} | {"GANGD_SOCKET": str(tmp_path / "gangd.sock")}
        proc = _as_from_a_terminal([PY, "-m", "gangd.client.cli", "ps"], env=env)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        silent.close()
    assert (proc.returncode, out, err) == (130, "", "gang: interrupted\n")
