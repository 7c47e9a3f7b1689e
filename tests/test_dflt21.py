"""A cluster job's checkpoints follow the cluster's ``[checkpoint] mode``, default adaptive (issue 17).

Until round 21 a job under the daemons wrote deltas only when it asked
(``--ckpt-mode``): the coordinator's gate made every other job write whole
files. Now a job that does not ask follows the cluster's mode (adaptive by
default) and ``--ckpt-mode full`` still writes whole files (every
generation's MANIFEST format 1, as before deltas: nothing needed). One 2-node
cluster for both jobs; the delta's offer is planned behind the begin, so a
delta written here also shows the capture waited for it.
"""

from __future__ import annotations

import msgpack

from gangd import ckptstore


def _manifest(gc, record: dict, lineage: int, gen: int, node: str) -> dict:
    from ckpthelpers import gen_dir

    return msgpack.unpackb((gen_dir(gc, node, lineage, gen) / ckptstore.MANIFEST).read_bytes(), raw=False)


def test_a_job_that_does_not_ask_writes_adaptive_deltas_and_one_that_asks_full_writes_whole_files(make_cluster, tmp_path):
    from ckpthelpers import generations, kill_what_is_left
    from test_delta_cluster import Steered, rank_file, take

    gc = make_cluster(2)
    try:
        taken: dict[str, tuple[int, dict]] = {}
        for name, options in (("default", ()), ("full", ("--ckpt-mode", "full"))):
            job = Steered(gc, tmp_path / name)
            current = job.submit(*options, "--ckpt-redundancy", "local")
            for step in (2, 4):
                job.go(step)
                assert take(gc, current)["state"] == "complete"
            taken[name] = current, {e["gen"]: e for e in generations(gc, current)}
            gc.gang("kill", current, check=True)

        job, entries = taken["default"]
        record = gc.job(job)
        second = entries[max(entries)]
        assert second["needs"] == [min(entries)] and second["mode"] == "differential", entries  # (adaptive: a differential)
        for rank in (0, 1):
            path = rank_file(gc, record, job, second["gen"], rank)
            assert path.stat().st_size < 512 * 1024 * 0.9, f"rank {rank} wrote {path.stat().st_size} bytes: a full file"
            assert _manifest(gc, record, job, second["gen"], record["placement"][rank])["format"] == 2
        row = next(line.split() for line in gc.gang("ckpt", "ls", job, check=True).stdout.splitlines()[1:] if line.split()[0] == str(second["gen"]))
        assert row[4:6] == ["differential", str(min(entries))], row

        job, entries = taken["full"]
        record = gc.job(job)
        assert all(not e.get("needs") and e.get("mode") in (None, "full") for e in entries.values()), entries
        for gen in entries:
            for rank in (0, 1):
                assert rank_file(gc, record, job, gen, rank).stat().st_size > 512 * 1024  # (the whole state)
                assert _manifest(gc, record, job, gen, record["placement"][rank])["format"] == 1
    finally:
        kill_what_is_left(gc)
