"""Issue 17, the node side of incremental checkpoints (DESIGN17 §4 WP-C).

What a rank may say it wrote (its links are hostile until checked against
the offer), MANIFEST format 2 with ``needs`` beside today's format 1, the
settings, and on a real cluster: the ``delta`` offer a rank gets at the
start sync, the ``needs`` its commit writes, the chain a restart hands
over, and ``--ckpt-mode`` from the command line to the rank's environment.

Ranks still write whole images (the rank side is another package): the
cluster tests run a probe program that uses ckptlib as any job does and
records what the daemon offered, and (``PROBE_CLAIM``) reports its whole
file as the delta the offer allows, as the rank side will.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import msgpack
import pytest
from deltahelpers import round_at_commit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gangd import ckptstore, jobs
from gangd.checkpoint import messages as m
from gangd.checkpoint import node as nd
from gangd.checkpoint import round as rd
from gangd.daemon import config as cfg
from gangd.redundancy import xor

MAX = 1 << 30


def offer(*gens: int, chain_max: int = 8) -> m.DeltaOffer:
    links = tuple(m.Link(g, f"/ckpt/job-7/gen-{g}/ranks/rank-0.state", (100, "ab" * 16)) for g in gens)
    return m.DeltaOffer("adaptive", 16, chain_max, 0.1, not links, links)


def report(**fields) -> dict:
    return {"size": 100, "digest": "ab" * 16, "seconds": 0.5, **fields}


# ---------------------------------------------------------------- write reports


def test_todays_report_is_a_full_file_with_its_size_as_state_and_restore():
    parsed = m.WriteReport.parse(report(), MAX)
    assert (parsed.role, parsed.parent, parsed.links, parsed.state, parsed.restore) == ("full", None, (), 100, 100)
    assert parsed.to_wire() == report()  # (unchanged on the wire)
    assert m.WriteReport.parse(report(), MAX, offer(4, 3), gen=5) == parsed  # an offer does not oblige a delta


def test_a_delta_naming_a_tail_of_the_offered_chain_is_taken():
    chain = offer(4, 3, 1)
    incr = m.WriteReport.parse(report(role="incr", parent=4, links=[4, 3, 1], state=5000, restore=300), MAX, chain, gen=5)
    assert (incr.role, incr.parent, incr.links, incr.state, incr.restore) == ("incr", 4, (4, 3, 1), 5000, 300)
    diff = m.WriteReport.parse(report(role="diff", parent=1, base=1, links=[1]), MAX, chain, gen=5)
    assert diff.links == (1,) and diff.base == 1
    rebase = m.WriteReport.parse(report(role="rebase", parent=4, base=5, links=[4, 3, 1]), MAX, chain, gen=5)
    assert rebase.base == 5
    assert m.WriteReport.parse(incr.to_wire(), MAX, chain, gen=5) == incr


@pytest.mark.parametrize(
    "fields, offered, words",
    [
        ({"role": "incr", "parent": 9, "links": [9]}, offer(4, 3), "not offered"),
        ({"role": "incr", "parent": 4, "links": [4]}, None, "no generation was offered"),
        ({"role": "incr", "parent": 4, "links": [4]}, offer(), "no generation was offered"),
        ({"role": "incr", "parent": 4, "links": [4, 1]}, offer(4, 3, 1), "not the tail"),  # skips 3
        ({"role": "incr", "parent": 3, "links": [3, 4]}, offer(4, 3), "not the tail"),  # oldest first
        ({"role": "incr", "parent": 4, "links": [4, 4]}, offer(4), "not the tail"),
        ({"role": "incr", "parent": 3, "links": [3, 2, 1]}, offer(3, 2, 1, chain_max=2), "chain_max"),
        ({"role": "incr", "parent": -1, "links": [-1]}, offer(4), "not offered"),
        ({"role": "incr", "parent": 4, "links": [4.0]}, offer(4), "not generation numbers"),
        ({"role": "incr", "parent": 4, "links": "4"}, offer(4), "not a list"),
        ({"role": "incr", "parent": 4, "links": list(range(100, 0, -1))}, offer(4), "at most 64"),
        ({"role": "incr", "parent": 4, "links": []}, offer(4), "names no generation"),
        ({"role": "incr", "parent": 3, "links": [4, 3]}, offer(4, 3), "not its newest link"),
        ({"role": "full", "links": [4]}, offer(4), "full file that needs"),
        ({"role": "full", "parent": 4}, offer(4), "full file with a parent"),
        ({"role": "delta"}, offer(4), "role"),
        ({"role": ["incr"]}, offer(4), "role"),
        ({"role": "diff", "parent": 4, "links": [4], "base": 2}, offer(4), "base"),
        ({"state": -5}, offer(4), "byte count"),
        ({"state": 2**70}, offer(4), "byte count"),
        ({"restore": "all"}, offer(4), "byte count"),
        ({"restore": MAX * 3}, offer(4), "byte count"),  # a full file's restore reads itself, at most the cap
    ],
)
def test_a_hostile_delta_report_is_refused_with_a_sentence(fields, offered, words):
    with pytest.raises(m.BadMessage, match=words):
        m.WriteReport.parse(report(**fields), MAX, offered, gen=5)


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ("size", "digest", "seconds", "role", "parent", "base", "links", "state", "restore")
OFFERED = st.lists(st.integers(1, 40), max_size=10, unique=True).map(lambda gens: sorted(gens, reverse=True))


@st.composite
def hostile_reports(draw):
    """A report that is close to a valid one: some fields valid, some of any type or range."""
    chain = draw(OFFERED)
    result: dict = report()
    if chain and draw(st.booleans()):
        k = draw(st.integers(1, len(chain)))
        result.update(role=draw(st.sampled_from(m.ROLES)), links=chain[-k:], parent=chain[-k])
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        result[key] = draw(JUNK | st.integers(-3, 45) | st.lists(st.integers(-3, 45), max_size=70))
    return chain, draw(st.integers(1, 10)), result


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(hostile_reports())
def test_fuzzed_reports_are_refused_or_name_only_what_was_offered(case):
    chain, chain_max, result = case
    offered = offer(*chain, chain_max=chain_max)
    try:
        parsed = m.WriteReport.parse(result, MAX, offered, gen=50)
    except m.BadMessage as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    assert 0 <= parsed.size <= MAX and parsed.state >= 0 and parsed.restore >= 0
    assert parsed.role in m.ROLES and all(type(g) is int for g in parsed.links)
    assert set(parsed.links) <= set(chain) and len(parsed.links) <= chain_max
    assert parsed.links == tuple(chain[len(chain) - len(parsed.links):])  # a tail: nothing skipped, newest first
    assert (parsed.role == "full") == (not parsed.links) and parsed.parent == (parsed.links[0] if parsed.links else None)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(hostile_reports())
def test_a_fuzzed_report_fails_the_round_with_a_sentence_or_is_taken(case):
    """The machine a daemon runs per round: a bad report fails the round
    (the coordinator aborts the generation); nothing raises."""
    chain, chain_max, result = case
    rnd = at_release(offers={0: offer(*chain, chain_max=chain_max)})
    rnd.handle(nd.Ended(0, result))
    assert (rnd.failed is None) == (0 in rnd.written)
    if rnd.failed:
        assert rnd.failed.startswith("rank 0 on n1 reported ")
    else:
        assert rnd.needs() == ({0: list(rnd.written[0].links)} if rnd.written[0].links else {})


def at_release(offers: dict) -> nd.NodeRound:
    rnd = nd.NodeRound(job=3, gen=50, lineage=3, node="n1", ranks=[0, 1], max_rank_bytes=MAX)
    rnd.handle(nd.Reported(0, m.RankReport(50, 7)))
    rnd.handle(nd.Reported(1, m.RankReport(50, 7)))
    rnd.handle(nd.CutSet(7))
    rnd.handle(nd.Arrived(0, 7, 0.0))
    rnd.handle(nd.Arrived(1, 7, 0.0))
    rnd.handle(nd.Released({0: "/x/rank-0.state", 1: "/x/rank-1.state"}, offers))
    assert rnd.phase is nd.NodePhase.RELEASED
    return rnd


def test_a_rank_may_only_name_its_own_offer():
    """Rank 1 was offered nothing (a full file): rank 0's chain is not its."""
    rnd = at_release(offers={0: offer(4, 3)})
    rnd.handle(nd.Ended(0, report(role="incr", parent=4, links=[4, 3])))
    rnd.handle(nd.Ended(1, report(role="incr", parent=4, links=[4, 3])))
    assert rnd.failed == "rank 1 on n1 reported a incr file, but no generation was offered to diff against (a full checkpoint was asked for)"


def test_the_offer_and_the_link_round_trip_and_are_checked():
    chain = offer(4, 3)
    assert m.DeltaOffer.from_wire(chain.to_wire()) == chain
    assert m.DeltaOffer.from_wire(offer().to_wire()) == offer()
    assert chain.chain == (4, 3) and offer().force_full
    with pytest.raises(ValueError):
        m.DeltaOffer("adaptive", 16, 8, 0.1, True, chain.links)
    for bad in ({**chain.to_wire(), "mode": "fast"}, {**chain.to_wire(), "force_full": True}, {**chain.to_wire(), "threshold": 2},
                {**chain.to_wire(), "links": [{"gen": 1, "path": "", "expect": [1, "a"]}]}):
        with pytest.raises(m.BadMessage):
            m.DeltaOffer.from_wire(bad)


# ---------------------------------------------------------------- the commit answer and the entry


def test_a_commit_answer_of_a_daemon_before_deltas_reads_as_full_files():
    old = {"node": "n1", "ranks": 2, "bytes": 300, "state_bytes": 200, "times": {"begin": 1.0}}
    answer = m.CommitAnswer.from_wire(old)
    assert (answer.written, answer.restore, answer.needs, answer.modes) == (200, 200, (), {})
    assert rd.delta_fields([answer]) == {"mode": "full", "needs": [], "written": 200, "restore_bytes": 200}
    new = m.CommitAnswer.from_wire({**old, "written": 20, "restore": 220, "needs": [3, 4, 3], "modes": {"incr": 2}})
    assert m.CommitAnswer.from_wire(new.to_wire()) == new and new.needs == (4, 3)
    both = rd.delta_fields([new, m.CommitAnswer.from_wire({**old, "node": "n2", "needs": [2], "modes": {"full": 1, "diff": 1}})])
    assert both == {"mode": "mixed", "needs": [4, 3, 2], "written": 220, "restore_bytes": 420}
    for bad in ({"needs": [0]}, {"needs": "4"}, {"modes": {"zip": 1}}, {"modes": {"incr": -1}}, {"written": -1}):
        with pytest.raises(m.BadMessage):
            m.CommitAnswer.from_wire({**old, **bad})


def test_a_compressed_write_s_figures_travel_checked_from_rank_to_entry():
    """Issue 18: a rank's pipeline figures and codecs reach the node's commit answer (summed over its ranks,
    the slowest rank's busy time per stage) and the generation's entry (node_stats, the codecs of delta_fields)."""
    def figures(raw, packed, busy):
        return {"in": raw, "out": packed, "stages": {"compress": {"busy_s": busy, "cpu_s": busy, "workers": 2, "bytes_in": raw},
                                                     "write": {"busy_s": 0.1, "cpu_s": 0.01, "evil": "x" * 100}}}
    reports = [m.WriteReport.parse({"size": 900, "digest": "d", "seconds": 0.5, "pipeline": figures(4000, 900, b), "codecs": c}, 10**6)
               for b, c in ((0.3, ["zstd:5@1", "none@1"]), (0.7, ["zstd:5@1"]))]
    assert reports[0].codecs == ("none@1", "zstd:5@1") and "evil" not in reports[0].pipeline["stages"]["write"]
    assert m.WriteReport.parse(reports[0].to_wire(), 10**6) == reports[0]
    node = m.merge_pipelines([r.pipeline for r in reports] + [None])
    assert (node["in"], node["out"]) == (8000, 1800)
    assert node["stages"]["compress"] == {"busy_s": 0.7, "cpu_s": 1.0, "workers": 2, "bytes_in": 8000}
    old = {"node": "n1", "ranks": 2, "bytes": 1800, "state_bytes": 8000, "times": {"released": 1.0, "written": 2.0, "at_cut": 0.9, "resumed": 1.1}}
    answer = m.CommitAnswer.from_wire({**old, "pipeline": node, "codecs": ["zstd:5@1", "none@1"]})
    assert m.CommitAnswer.from_wire(answer.to_wire()) == answer
    stats = rd.node_stats(answer.to_wire(), answer)
    assert stats["pipeline"] == node and stats["blocked"] == pytest.approx(0.2) and stats["disk"] == pytest.approx(1.0)
    assert "pipeline" not in rd.node_stats(old, m.CommitAnswer.from_wire(old))  # (a raw write, or a daemon before issue 18)
    assert rd.delta_fields([answer])["codecs"] == ["none@1", "zstd:5@1"] and "codecs" not in rd.delta_fields([m.CommitAnswer.from_wire(old)])


@pytest.mark.parametrize("bad", [
    {"pipeline": []}, {"pipeline": {"in": -1}}, {"pipeline": {"in": 1, "out": 1, "stages": {"a b": {}}}},
    {"pipeline": {"in": 1, "out": 1, "stages": {"w": {"busy_s": float("nan")}}}},
    {"pipeline": {"in": 1, "out": 1, "stages": {"w": {"bytes_in": 1.5}}}},
    {"pipeline": {"in": 1, "out": 1, "stages": {f"s{i}": {} for i in range(9)}}},
    {"codecs": "zstd"}, {"codecs": ["zstd:5@1"] * 65}, {"codecs": ["\x1b[31m"]}, {"codecs": ["x" * 65]}, {"codecs": [5]},
])
def test_hostile_pipeline_figures_or_codecs_are_refused(bad):
    with pytest.raises(m.BadMessage):
        m.WriteReport.parse({"size": 1, "digest": "d", **bad}, 10**6)
    with pytest.raises(m.BadMessage):
        m.CommitAnswer.from_wire({"node": "n1", "ranks": 1, "bytes": 1, "state_bytes": 1, "times": {}, **bad})


@pytest.mark.parametrize("modes, mode", [({}, "full"), ({"full": 3}, "full"), ({"incr": 2, "full": 0}, "incremental"),
                                         ({"diff": 1}, "differential"), ({"diff": 1, "rebase": 1}, "mixed"),
                                         ({"rebase": 2}, "rebase"), ({"full": 1, "incr": 1}, "mixed")])
def test_a_generations_mode_follows_its_files_roles(modes, mode):
    assert m.generation_mode(modes) == mode


def test_a_complete_round_records_mode_needs_written_and_restore_bytes():
    r = round_at_commit()
    base = {"ranks": 1, "bytes": 30, "state_bytes": 1000, "times": {"begin": 1.0, "committed": 2.0}}
    out = []
    for node in ("n1", "n2"):
        out += r.handle(rd.Answered(5, rd.Phase.COMMIT, node, {**base, "node": node, "written": 10, "restore": 900, "needs": [4, 3], "modes": {"incr": 1}}))
    entry = out[0].entry
    assert (entry["state"], entry["mode"], entry["needs"], entry["written"], entry["restore_bytes"]) == ("complete", "incremental", [4, 3], 20, 1800)


# ---------------------------------------------------------------- manifests


def today_pack(manifest: ckptstore.Manifest) -> bytes:
    """What ``Manifest.pack`` wrote before format 2 (main at 80f4380)."""
    fields = {k: getattr(manifest, k) for k in ("lineage", "gen", "node", "iteration", "files", "ranks", "committed")}
    return msgpack.packb({"format": 1, **fields}, use_bin_type=True)


def test_a_manifest_of_whole_files_is_todays_format_1_byte_for_byte(tmp_path):
    manifest = ckptstore.Manifest(7, 3, "n1", 10, {"ranks/rank-0.state": [5, "ab"], "job.msgpack": [2, "cd"]}, [0], 12.5)
    assert manifest.pack() == today_pack(manifest)
    (tmp_path / ckptstore.MANIFEST).write_bytes(today_pack(manifest))  # a generation written before deltas
    again = ckptstore.read_manifest(tmp_path)
    assert again == manifest and again.needs == {} and again.links("ranks/rank-0.state") == []
    assert ckptstore.verify(tmp_path) != []  # (the files are missing: verify still reads the manifest)


def test_a_delta_manifest_is_format_2_and_round_trips_its_needs(tmp_path):
    files = {"ranks/rank-0.state": [5, "ab"], "ranks/rank-1.state": [9, "ef"], "job.msgpack": [2, "cd"]}
    manifest = ckptstore.Manifest(7, 5, "n1", 10, files, [0, 1], 12.5, {"ranks/rank-0.state": [4, 2, 1]})
    assert msgpack.unpackb(manifest.pack())["format"] == 2
    ckptstore.write_manifest(tmp_path, manifest)
    again = ckptstore.read_manifest(tmp_path)
    assert again == manifest and again.links("ranks/rank-0.state") == [4, 2, 1] and again.links("ranks/rank-1.state") == []


@pytest.mark.parametrize(
    "change, words",
    [
        ({"format": 3}, "format 3 is not supported"),
        ({"format": 1, "needs": {}}, "format 1 manifest has no 'needs'"),
        ({"needs": {"ranks/rank-9.state": [4]}}, "does not list"),
        ({"needs": {"ranks/rank-0.state": [5]}}, "older than 5"),  # itself
        ({"needs": {"ranks/rank-0.state": [0]}}, "older than 5"),
        ({"needs": {"ranks/rank-0.state": [2, 4]}}, "newest first"),
        ({"needs": {"ranks/rank-0.state": [4, 4]}}, "newest first"),
        ({"needs": {"ranks/rank-0.state": list(range(4, 0, -1)) * 20}}, "at most 64"),
        ({"needs": {"ranks/rank-0.state": "4"}}, "at most 64"),
        ({"needs": [["ranks/rank-0.state", [4]]]}, "unreadable"),
        ({"extra": 1}, "unreadable"),
    ],
)
def test_a_hostile_manifest_is_an_error_naming_it(tmp_path, change, words):
    raw = {"format": 2, "lineage": 7, "gen": 5, "node": "n1", "iteration": 10, "files": {"ranks/rank-0.state": [5, "ab"]},
           "ranks": [0], "committed": 1.0, "needs": {"ranks/rank-0.state": [4]}, **change}
    (tmp_path / ckptstore.MANIFEST).write_bytes(msgpack.packb(raw, use_bin_type=True))
    with pytest.raises(ckptstore.StoreError, match=words) as info:
        ckptstore.read_manifest(tmp_path)
    assert str(tmp_path / ckptstore.MANIFEST) in str(info.value)


def test_xor_parity_keeps_each_members_needs_through_a_rebuild(tmp_path):
    """xor.meta embeds every member's MANIFEST: a lost member's format 2
    manifest comes back with its needs, a format 1 one as it was."""
    nodes = ["n1", "n2", "n3"]
    dirs = [ckptstore.gen_dir(tmp_path / node, 7, 5) for node in nodes]
    for i, (node, directory) in enumerate(zip(nodes, dirs, strict=True)):
        (directory / "ranks").mkdir(parents=True)
        name = f"ranks/rank-{i}.state"
        files = {name: list(ckptstore.write_atomic(directory / name, [os.urandom(1000 + 300 * i)]))}
        needs = {name: [4, 3]} if i != 1 else {}
        ckptstore.write_manifest(directory, ckptstore.Manifest(7, 5, node, 10, files, [i], time.time(), needs))
    before = [ckptstore.read_manifest(d) for d in dirs]
    xor.encode_set(dirs, nodes)
    for lost in (0, 1):
        shutil.rmtree(dirs[lost])
        survivors: list[Path | None] = list(dirs)
        survivors[lost] = None
        rebuilt = xor.rebuild_local(survivors, lost, dirs[lost])
        assert rebuilt.needs == before[lost].needs and ckptstore.read_manifest(dirs[lost]).needs == before[lost].needs
        assert ckptstore.verify(dirs[lost]) == []


# ---------------------------------------------------------------- the parent a node may offer


def entry(gen: int, state: str = "complete", placement=("n1", "n2"), **extra) -> dict:
    return {"gen": gen, "state": state, "placement": list(placement), **extra}


def test_the_candidates_are_the_newest_sound_generations_of_the_same_layout():
    entries = [entry(1), entry(2, "protected"), entry(3, "aborted"), entry(4, redundancy="failed: node lost"), entry(5), entry(6, "running")]
    found = nd.parent_candidates(entries, ["n1", "n2"], 6, 4)
    assert found.parents == (5, 2, 1) and found.linkable == {1, 2, 5}
    assert nd.parent_candidates(entries, ["n1", "n2"], 6, 2).parents == (5, 2)
    assert nd.parent_candidates(entries, ["n1", "n2"], 2, 4).parents == (1,)  # never itself or a newer one
    first = nd.parent_candidates([], ["n1", "n2"], 1, 4)
    assert first.parents == () and first.why == "no complete generation to build on"


def test_a_layout_change_offers_no_parent_until_a_generation_of_the_new_layout_exists():
    entries = [entry(1), entry(2), entry(3, placement=("n2", "n1"))]
    moved = nd.parent_candidates(entries[:2], ["n2", "n1"], 3, 4)
    assert moved.parents == () and moved.why == "the ranks moved since generation 2"
    assert nd.parent_candidates(entries, ["n2", "n1"], 4, 4).parents == (3,)  # (not 2 or 1: another layout)


# ---------------------------------------------------------------- settings


def write_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "gangd.toml"
    path.write_text('[node]\nname = "a"\n' + extra + '\n[[nodes]]\nname = "a"\naddress = "127.0.0.1"\n[etcd]\nendpoints = ["http://127.0.0.1:2379"]\n')
    return path


def test_the_delta_settings_default_and_load_and_render(tmp_path):
    config = cfg.load(write_config(tmp_path))
    assert (config.checkpoint_mode, config.checkpoint_block_kib, config.checkpoint_chain_max, config.checkpoint_adaptive_threshold) == (
        "adaptive", 16, 8, 0.10)
    config = cfg.load(write_config(tmp_path, '[checkpoint]\nmode = "incremental"\nblock_kib = 64\nchain_max = 4\nadaptive_threshold = 0.25\n'))
    assert (config.checkpoint_mode, config.checkpoint_block_kib, config.checkpoint_chain_max, config.checkpoint_adaptive_threshold) == (
        "incremental", 64, 4, 0.25)
    (tmp_path / "again").mkdir()
    again = tmp_path / "again" / "gangd.toml"
    again.write_text(cfg.render(config))
    assert cfg.load(again) == config


@pytest.mark.parametrize("line, words", [('mode = "fast"', "mode must be one of"), ("block_kib = 0", "block_kib"), ('block_kib = "16"', "block_kib"),
                                         ("chain_max = 0", "chain_max"), ("chain_max = 65", "chain_max"), ("chain_max = true", "chain_max"),
                                         ("adaptive_threshold = 1.5", "adaptive_threshold"), ("adaptive_threshold = -0.1", "adaptive_threshold")])
def test_bad_delta_settings_are_refused_with_a_sentence(tmp_path, line, words):
    with pytest.raises(cfg.ConfigError, match=words):
        cfg.load(write_config(tmp_path, f"[checkpoint]\n{line}\n"))


def test_the_job_spec_takes_a_checkpoint_mode_and_refuses_others():
    spec = {"argv": ["x"], "nranks": 2}
    assert jobs.JobSpec.from_wire(spec, ["n1"]).ckpt_mode is None
    checked = jobs.JobSpec.from_wire({**spec, "ckpt_mode": "differential"}, ["n1"])
    assert checked.ckpt_mode == "differential" and checked.as_spec()["ckpt_mode"] == "differential"
    record = jobs.new_record(job_id=4, spec=checked.as_spec(), owner_uid=0, owner_name="root", owner_gid=0)
    assert record["ckpt_mode"] == "differential"
    for bad in ("fast", 3, ["full"]):
        with pytest.raises(jobs.BadSpec, match="checkpoint mode must be one of full, incremental, differential, adaptive"):
            jobs.JobSpec.from_wire({**spec, "ckpt_mode": bad}, ["n1"])


# ---------------------------------------------------------------- on a cluster: the offer, the needs, the chain

PROBE = '''
"""A rank that checkpoints as any job does (ckptlib, whole images), and
records what its daemon offered at each start sync and handed over at
attach; with the claim in PROBE_CLAIM_FILE it reports its file as the delta
the offer allows ("chain": an incremental of the offered parent) or as the
JSON fields given (a hostile rank)."""
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from gangd import ckptlib as ckpt
from gangd.ckptlib import agent

rank = int(os.environ["GANGD_RANK"])
log = Path(os.environ["PROBE_LOG"]) / f"job-{os.environ['GANGD_JOB']}-rank-{rank}.jsonl"
release = Path(os.environ["PROBE_RELEASE"])
claim_file = Path(os.environ["PROBE_CLAIM_FILE"])
offers = {}
real_init, real_call = agent.DaemonAgent.__init__, agent.DaemonAgent.call


def emit(kind, **fields):
    with open(log, "a") as fh:
        fh.write(json.dumps({"kind": kind, "rank": rank, **fields}) + "\\n")


def init(self, info):
    real_init(self, info)
    emit("attach", restart=self.restart, mode=os.environ.get("GANGD_CKPT_MODE"))


def call(self, op, args):
    if op == "ckpt_end" and args.get("result") is not None:
        claim = claim_file.read_text().strip() if claim_file.exists() else ""
        delta = offers.get(args["gen"]) or {}
        chain = [link["gen"] for link in delta.get("links", [])]
        result = dict(args["result"])
        if claim == "chain-gone" and chain:  # its oldest link vanishes before the commit (as a removal would do it)
            shutil.rmtree(Path(delta["links"][-1]["path"]).parent.parent, ignore_errors=True)
        if claim.startswith("chain") and chain and len(chain) <= delta["chain_max"]:
            result.update(role="incr", parent=chain[0], base=chain[-1], links=chain, restore=result["size"] * (len(chain) + 1))
        elif claim.startswith("{"):
            result.update(json.loads(claim))
        args = {**args, "result": result}
    reply = real_call(self, op, args)
    if op == "ckpt_start":
        offers[args["gen"]] = reply.get("delta")
        emit("offer", gen=args["gen"], delta=reply.get("delta"))
    return reply


agent.DaemonAgent.__init__ = init
agent.DaemonAgent.call = call
ckpt.init(background=False, block_kib=1)  # (8 blocks: a step changes one, so the files are the deltas the claims say)
state = ckpt.protect("state", np.arange(1000.0) + rank)
emit("ready")
for k in ckpt.loop(range(1_000_000)):
    state[k % 1000] += 1
    if release.exists():
        break
    time.sleep(0.02)
print("RESULT", rank, float(state.sum()))
'''


class Probe:
    """The probe program and its files, for one test."""

    def __init__(self, gc, tmp: Path):
        self.gc, self.dir = gc, tmp
        tmp.mkdir(mode=0o755, exist_ok=True)
        self.program = tmp / "probe.py"
        self.program.write_text(PROBE)
        self.release, self.claim_file = tmp / "release", tmp / "claim"
        self.env = {**os.environ, "PROBE_LOG": str(tmp), "PROBE_RELEASE": str(self.release), "PROBE_CLAIM_FILE": str(self.claim_file)}

    def submit(self, *options) -> int:
        from ckpthelpers import PY

        return int(self.gc.gang("submit", "-n", 2, *options, "--", PY, self.program, check=True, env=self.env).stdout)

    def claim(self, what: str) -> None:
        self.claim_file.write_text(what)

    def events(self, job: int, kind: str) -> list[dict]:
        out = []
        for rank in (0, 1):
            path = self.dir / f"job-{job}-rank-{rank}.jsonl"
            if path.exists():
                out += [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]
        return out

    def wait_ready(self, job: int) -> None:
        from conftest import wait_for

        wait_for(lambda: len(self.events(job, "ready")) == 2, 60, f"job {job}'s ranks to call ckpt.init()")

    def offers(self, job: int, gen: int) -> dict[int, dict]:
        return {e["rank"]: e["delta"] for e in self.events(job, "offer") if e["gen"] == gen}

    def checkpoint(self, job: int) -> dict:
        from ckpthelpers import checkpoint

        return checkpoint(self.gc, job)


def rank_dir(gc, record: dict, rank: int, gen: int) -> Path:
    from ckpthelpers import gen_dir

    return gen_dir(gc, record["placement"][rank], record.get("lineage") or record["id"], gen)


def raw_manifest(directory: Path) -> dict:
    return msgpack.unpackb((directory / ckptstore.MANIFEST).read_bytes(), raw=False)


@pytest.fixture
def probe_cluster(make_cluster, tmp_path):
    from ckpthelpers import kill_what_is_left

    gc = make_cluster(2)
    probe = Probe(gc, tmp_path / "probe")
    yield gc, probe
    probe.release.touch()
    kill_what_is_left(gc)


def test_each_rank_is_offered_the_newest_generation_with_its_chain_and_a_restart_gets_the_chain(probe_cluster):
    """A 2-node job in --ckpt-mode incremental whose ranks report the deltas
    they were offered: the first checkpoint is full, each next one is offered
    the previous generation and its chain (paths and checksums of this node's
    MANIFESTs), the commit writes the needs (MANIFEST format 2, and the
    entry's mode, needs and bytes), and a restart hands each rank its chain."""
    from ckpthelpers import USABLE, generations, kill_and_restart, wait_running_a_bit

    gc, probe = probe_cluster
    probe.claim("chain")
    job = probe.submit("-N", 2, "--ckpt-mode", "incremental", "--ckpt-redundancy", "local")
    probe.wait_ready(job)
    assert {e["mode"] for e in probe.events(job, "attach")} == {"incremental"}  # GANGD_CKPT_MODE
    record = gc.job(job)
    assert sorted(record["placement"]) == ["n1", "n2"]
    committed: dict[tuple[int, int], ckptstore.Manifest] = {}  # (read as each commits: retention may remove it later)
    for gen in (1, 2, 3):
        assert probe.checkpoint(job)["state"] == "complete"
        for rank in (0, 1):
            committed[rank, gen] = ckptstore.read_manifest(rank_dir(gc, record, rank, gen))
        offers = probe.offers(job, gen)
        assert set(offers) == {0, 1}
        for rank, delta in offers.items():
            assert (delta["mode"], delta["block_kib"], delta["chain_max"], delta["threshold"]) == ("incremental", 16, 8, 0.1)
            assert [link["gen"] for link in delta["links"]] == list(range(gen - 1, 0, -1)), (gen, rank, delta)
            assert delta["force_full"] == (gen == 1)
            name = ckptstore.cluster_rank_file(rank)
            for link in delta["links"]:
                assert link["path"] == str(rank_dir(gc, record, rank, link["gen"]) / name)
                assert link["expect"] == committed[rank, link["gen"]].files[name]
            manifest = committed[rank, gen]
            assert manifest.needs == ({name: list(range(gen - 1, 0, -1))} if gen > 1 else {})
            assert raw_manifest(rank_dir(gc, record, rank, gen))["format"] == (2 if gen > 1 else 1)
    listed = {g["gen"]: g for g in generations(gc, job)}
    assert [listed[g]["mode"] for g in (1, 2, 3)] == ["full", "incremental", "incremental"]
    assert [listed[g]["needs"] for g in (1, 2, 3)] == [[], [1], [2, 1]]
    for g in (1, 2, 3):
        state = sum(n["state_bytes"] for n in listed[g]["nodes"].values())
        assert state > 0 and (listed[g]["written"] >= state) == (g == 1)  # (a whole image with its index, then deltas)
        assert listed[g]["restore_bytes"] == listed[g]["written"] * g  # (the probe's claim: each link read whole)

    # Whatever retention keeps, an offer names only generations that are there.
    assert probe.checkpoint(job)["state"] == "complete"
    listed = {g["gen"]: g for g in generations(gc, job)}
    for delta in probe.offers(job, 4).values():
        links = [link["gen"] for link in delta["links"]]
        assert links in ([], [3, 2, 1]) and all(listed[g]["state"] in USABLE for g in links)
        assert all(Path(link["path"]).exists() for link in delta["links"])
    assert probe.checkpoint(job)["state"] == "complete"
    listed = {g["gen"]: g for g in generations(gc, job)}
    newest = max(g for g, e in listed.items() if e["state"] in USABLE and all(listed[n]["state"] in USABLE for n in e["needs"]) and e["needs"])
    chain = listed[newest]["needs"]

    restarted = kill_and_restart(gc, job, "-g", newest)
    wait_running_a_bit(gc, restarted, 0)
    probe.wait_ready(restarted)
    attached = {e["rank"]: e for e in probe.events(restarted, "attach")}
    assert {e["mode"] for e in attached.values()} == {"incremental"}  # (the lineage's mode: a restart keeps it)
    for rank, event in attached.items():
        name = ckptstore.cluster_rank_file(rank)
        assert event["restart"]["gen"] == newest
        assert [link["gen"] for link in event["restart"]["chain"]] == chain
        for link in event["restart"]["chain"]:
            held = rank_dir(gc, record, rank, link["gen"])
            assert (link["path"], link["expect"]) == (str(held / name), ckptstore.read_manifest(held).files[name])
    gen = probe.checkpoint(restarted)
    assert gen["state"] == "complete"
    for delta in probe.offers(restarted, gen["gen"]).values():  # (the lineage's generations, read from the history)
        assert [link["gen"] for link in delta["links"]][:1] == [newest]


def test_a_layout_change_forces_full_files_and_a_hostile_report_aborts_only_its_generation(probe_cluster):
    """Both ranks on n1, the cluster's mode: a rank naming links it was not
    offered aborts that generation with a sentence (the daemons and the job
    go on); a link that vanishes between the offer and the commit aborts it
    too, and is offered no more; a restart from a generation whose link is
    gone fails its launch naming the link; a restart on 2 nodes (a rank
    moved) is offered full files, then a chain of the new layout."""
    from ckpthelpers import generations

    gc, probe = probe_cluster
    job = probe.submit("-w", "n1", "--ckpt-redundancy", "local", "--ckpt-mode", "adaptive")
    probe.wait_ready(job)
    assert {e["mode"] for e in probe.events(job, "attach")} == {"adaptive"}
    probe.claim(json.dumps({"role": "incr", "parent": 1, "links": [1]}))
    refused = probe.checkpoint(job)
    assert refused["state"] == "aborted" and "no generation was offered to diff against" in refused["reason"]
    probe.claim("")
    assert probe.checkpoint(job)["state"] == "complete"
    first = max(g["gen"] for g in generations(gc, job) if g["state"] == "complete")
    probe.claim(json.dumps({"role": "incr", "parent": 99, "links": [99, first]}))
    refused = probe.checkpoint(job)
    assert refused["state"] == "aborted" and "were not offered" in refused["reason"], refused
    assert [e["mode"] for e in probe.offers(job, refused["gen"]).values()] == ["adaptive", "adaptive"]
    probe.claim("chain")
    gen = probe.checkpoint(job)
    assert gen["state"] == "complete" and {g["gen"]: g for g in generations(gc, job)}[gen["gen"]]["needs"] == [first]
    assert all(r["state"] == "up" for r in gc.gang_json("nodes")["nodes"])
    probe.claim("chain-gone")  # the generation it needs vanishes between the offer and the commit
    gone = probe.checkpoint(job)
    assert gone["state"] == "aborted" and f"gen-{first}" in gone["reason"] and "which rank 0's file needs, is gone" in gone["reason"], gone
    probe.claim("chain")
    again = probe.checkpoint(job)
    assert again["state"] == "complete"
    assert [d["links"] for d in probe.offers(job, again["gen"]).values()] == [[], []]  # (the only chain left is broken)

    gc.gang("kill", job, check=True)
    broken = gc.gang("restart", job, "-g", gen["gen"], "--json")  # (needs the one gone: the coordinator's verify names it)
    assert broken.returncode != 0
    assert f"generation {gen['gen']}: it needs generation {first}, which is damaged: n1: " in broken.stderr, broken.stderr
    assert f"gen-{first}" in broken.stderr
    restarted = json.loads(gc.gang("restart", job, "--json", "-N", 2, check=True).stdout)["record"]["id"]
    probe.wait_ready(restarted)
    assert sorted(gc.job(restarted)["placement"]) == ["n1", "n2"]  # (a rank moved to n2)
    moved = probe.checkpoint(restarted)
    assert moved["state"] == "complete"
    offers = probe.offers(restarted, moved["gen"])
    assert all(d["force_full"] and d["links"] == [] for d in offers.values()), offers
    after = probe.checkpoint(restarted)
    assert after["state"] == "complete"
    assert all([link["gen"] for link in d["links"]] == [moved["gen"]] for d in probe.offers(restarted, after["gen"]).values())


def test_a_staged_manifest_keeps_the_needs_of_the_files_that_stay():
    from gangd.daemon.staging import merged

    local = ckptstore.Manifest(7, 5, "n1", 10, {"ranks/rank-0.state": [5, "ab"], "ranks/rank-1.state": [6, "cd"]}, [0, 1], 1.0,
                               {"ranks/rank-0.state": [4], "ranks/rank-1.state": [4, 3]})
    staged = merged(local, 7, 5, "n1", 10, {"ranks/rank-1.state": [9, "ef"], "ranks/rank-2.state": [8, "01"]}, {1, 2}, {"ranks/rank-2.state": [3]})
    assert staged.needs == {"ranks/rank-0.state": [4], "ranks/rank-2.state": [3]}  # (rank 1's landed whole: its old links went with it)
    assert merged(None, 7, 5, "n1", 10, {"ranks/rank-2.state": [8, "01"]}, {2}).needs == {}
