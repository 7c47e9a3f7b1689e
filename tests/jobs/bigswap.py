"""Two ranks swap large arrays many times; every byte is checked.

With a short gang time slice the job is stopped and resumed many times in
the middle of transfers. Prints `bigswap OK <transfers>` on rank 0.

    python bigswap.py --mib 32 --times 10
"""

from __future__ import annotations

import argparse

import numpy as np

from gangd import comm


def pattern(rank: int, i: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * (2 * i + 1) + rank).astype(np.uint64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--times", type=int, default=10)
    args = parser.parse_args()
    w = comm.world()
    assert w.size == 2, "bigswap needs exactly 2 ranks"
    peer = 1 - w.rank
    n = args.mib * (1 << 20) // 8
    for i in range(args.times):
        # Both send first: the engine must keep receiving while it sends.
        w.send(pattern(w.rank, i, n), peer, tag=i)
        got = w.recv(source=peer, tag=i)
        if not np.array_equal(got, pattern(peer, i, n)):
            bad = int(np.argmax(got != pattern(peer, i, n)))
            raise AssertionError(f"transfer {i}: element {bad} differs")
    w.barrier()
    if w.rank == 0:
        print(f"bigswap OK {args.times} transfers of {args.mib} MiB each way", flush=True)


if __name__ == "__main__":
    main()
