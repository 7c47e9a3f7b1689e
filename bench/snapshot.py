"""What a background checkpoint costs the job after the fork: copy-on-write, and the next fork.

A background checkpoint (ckptlib's default) forks the job; the fork writes
the state while the job runs on. Until the fork has copied a page, the job's
first write to it is a copy-on-write fault (a fresh page, a 4 KiB copy, a
huge page split into small ones), and split pages make the *next* fork copy
512 times more page table, in the job's blocked time. Since issue 18 the
snapshot lets go of the job's pages as it copies them (a raw file: each
array's pages as they are written; any file: all of them once its bytes are
all copied, before its fsync; gangd.ckptlib.letgo): the job's later writes
are then no copies at all, and its huge pages stay whole.

One process, one ``--mib`` float64 array (default 256), ``--rounds``
checkpoints through gangd.ckptlib.writer.write (raw, full, durable, like a
rank's). After each fork the job sweeps its whole state once, in 16 slices
spread over ``--period`` seconds (a stencil's iteration), then waits until
the snapshot is durable. Three variants in the same run, one after the
other, each in a process of its own (a fork copies the page tables of
everything its process has):

  no snapshot   the same sweeps with no checkpoint: the baseline;
  kept          the snapshot keeps its mappings until it exits (before issue 18's
                let-go: ``letgo.let_go`` and ``letgo.AsCopied`` replaced by no-ops
                in this process);
  let go        ckptlib as it is.

Printed per variant (medians over rounds, the first round left out): the
fork (what the job is blocked for), the sweep's time against the baseline's,
and the state's huge pages after the round.

    python bench/snapshot.py [--mib 256] [--rounds 6] [--period 1.0] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gangd.ckptlib import letgo, writer

SLICES = 16


def huge_mib(state: np.ndarray) -> float:
    """MiB of ``state``'s mappings backed by transparent huge pages (its VMAs in /proc/self/smaps)."""
    low = state.__array_interface__["data"][0]
    high = low + state.nbytes
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start < high and end > low
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total / 1024


def sweep(state: np.ndarray, period: float) -> float:
    """Write every element once, in slices spread over ``period`` s; the seconds spent writing."""
    step = -(-len(state) // SLICES)
    spent = 0.0
    for i in range(SLICES):
        began = time.perf_counter()
        part = state[i * step : (i + 1) * step]
        part += 1.0
        spent += time.perf_counter() - began
        time.sleep(period / SLICES)
    return spent


def one_round(variant: str, state: np.ndarray, path: Path, period: float) -> dict:
    if variant == "no snapshot":
        return {"fork": 0.0, "sweep": sweep(state, period), "huge": huge_mib(state)}
    began = time.perf_counter()
    written = writer.write(path, {"u": state}, 0, background=True)
    fork = time.perf_counter() - began
    spent = sweep(state, period)
    result = written.wait()
    if "error" in result:
        raise SystemExit(f"the snapshot failed: {result['error']}")
    path.unlink(missing_ok=True)
    return {"fork": fork, "sweep": spent, "huge": huge_mib(state)}


def run_variant(name: str, mib: int, rounds: int, period: float, where: Path) -> list[dict]:
    """Every round of one variant, in this process (the child's: its page tables hold only this state)."""
    if name == "kept":  # (what a snapshot did before issue 18's let-go)
        letgo.let_go = lambda values: 0
        letgo.AsCopied = lambda values: None  # type: ignore[assignment,misc]
    state = np.full(mib << 17, 0.5)
    return [one_round(name, state, where / "rank-0.state", period) for _ in range(rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--period", type=float, default=1.0, help="seconds over which the job sweeps its state once after each fork")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary directory here)")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # (a child's)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first is left out)")
    if args.variant is not None:
        where = Path(tempfile.mkdtemp(prefix="gangd-bench-snapshot-", dir=args.dir or "."))
        try:
            print(json.dumps(run_variant(args.variant, args.mib, args.rounds, args.period, where)))
        finally:
            shutil.rmtree(where, ignore_errors=True)
        return
    rows: dict[str, list[dict]] = {}
    for name in ("no snapshot", "kept", "let go"):  # each in a process of its own: a fork copies the page tables of all it has
        argv = [sys.executable, __file__, "--variant", name, "--mib", str(args.mib), "--rounds", str(args.rounds),
                "--period", str(args.period), *(["--dir", args.dir] if args.dir else [])]
        rows[name] = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name][1:])

    base = med("no snapshot", "sweep")
    print(f"{args.mib} MiB float64, {args.rounds} rounds (the first left out), the state swept once over {args.period} s after each fork")
    print(f"{'variant':12} {'fork ms':>8} {'sweep ms':>9} {'x no snapshot':>14} {'huge pages MiB':>15}")
    for name in rows:
        print(f"{name:12} {1000 * med(name, 'fork'):8.2f} {1000 * med(name, 'sweep'):9.1f} {med(name, 'sweep') / base:14.2f} "
              f"{med(name, 'huge'):15.0f}")
    print("fork: the job blocked while the snapshot is forked; sweep: the job's time writing its state once after the fork;")
    print("huge pages: of the state after its round (AnonHugePages of its mappings; the machine's THP setting decides)")


if __name__ == "__main__":
    main()
