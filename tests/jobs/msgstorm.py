"""A job that checks every message it gets: random patterns, sizes 0 B .. several MiB.

Every rank derives the whole communication plan from the seed, so each
receiver knows exactly which messages must arrive from whom, in which order
and with which contents. Per round each rank sends its planned messages
(ndarrays of several dtypes, raw bytes, pickled objects) to random peers,
then receives everything planned for it — half of the time with ANY source,
otherwise by source — and checks size, contents, per-pair order (no loss, no
duplicate, no reordering). Ends with an allreduce of the counts and prints
`msgstorm OK ...` on rank 0; any violation raises (the job fails).

    python msgstorm.py --rounds 20 --max-size 4194304 --seed 1
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from gangd import comm

DTYPES = [np.uint8, np.int32, np.float64, np.complex128, np.int16]


def plan(seed: int, rnd: int, size: int, max_size: int) -> list[list[tuple[int, int]]]:
    """plan[src] = [(dst, nbytes), ...] for round ``rnd`` (same on every rank)."""
    out = []
    for src in range(size):
        rng = random.Random(f"{seed}:{rnd}:{src}")
        sends = []
        for _ in range(rng.randint(0, 2 * size)):
            dst = rng.randrange(size)
            if dst == src:
                continue
            # Log-uniform sizes: many small, some large, a few of max_size.
            nbytes = 0 if rng.random() < 0.1 else int(2 ** rng.uniform(0, np.log2(max_size)))
            sends.append((dst, nbytes))
        out.append(sends)
    return out


def payload(src: int, dst: int, seq: int, nbytes: int):
    kind = seq % 4
    if kind == 3 and nbytes < 4096:
        return {"src": src, "dst": dst, "seq": seq, "blob": bytes((src + dst + seq + i) % 251 for i in range(nbytes))}
    if kind == 2:
        return bytes(np.arange(nbytes, dtype=np.uint32).astype(np.uint8) ^ ((src * 7 + dst * 3 + seq) % 256))
    dtype = np.dtype(DTYPES[seq % len(DTYPES)])
    count = nbytes // dtype.itemsize
    arr = np.arange(count, dtype=np.int64) * (seq + 1) + src * 1000 + dst
    return arr.astype(dtype)


def same(a, b) -> bool:
    if isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-size", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    w = comm.world()
    me, n = w.rank, w.size
    sent_seq = [0] * n  # next sequence number per destination
    recv_seq = [0] * n  # next expected per source
    received = 0
    volume = 0
    for rnd in range(args.rounds):
        p = plan(args.seed, rnd, n, args.max_size)
        for dst, nbytes in p[me]:
            seq = sent_seq[dst]
            sent_seq[dst] += 1
            w.send(payload(me, dst, seq, nbytes), dst, tag=rnd)
        expected = {src: sum(1 for d, _ in p[src] if d == me) for src in range(n)}
        sizes = {src: [b for d, b in p[src] if d == me] for src in range(n)}
        got = dict.fromkeys(range(n), 0)
        by_any = random.Random(f"{args.seed}:{rnd}:{me}:any").random() < 0.5
        pending = sum(expected.values())
        while pending:
            if by_any:
                # A fast peer may already send the next round: the tag keeps rounds apart.
                obj, status = w.recv(source=comm.ANY, tag=rnd, status=True)
                src = status.source
            else:
                # From one source the oldest message comes first: this round's (per-pair order).
                src = next(s for s in range(n) if got[s] < expected[s])
                obj, status = w.recv(source=src, tag=comm.ANY, status=True)
                assert status.source == src, (status.source, src)
            if got[src] >= expected[src]:
                raise AssertionError(f"round {rnd}: rank {me} got an extra message from {src} (duplicate?)")
            seq = recv_seq[src]
            want = payload(src, me, seq, sizes[src][got[src]])
            if status.tag != rnd:
                raise AssertionError(f"round {rnd}: from {src} a message of round {status.tag} (reordered or lost)")
            if not same(obj, want):  # the contents encode the per-pair sequence number: order is checked too
                raise AssertionError(f"round {rnd}: message {seq} from {src} to {me} is corrupted, lost or out of order")
            recv_seq[src] += 1
            got[src] += 1
            pending -= 1
            received += 1
            volume += sizes[src][got[src] - 1]
        if rnd % 3 == 2:
            w.barrier()
    totals = w.allreduce(np.array([received, volume, sum(sent_seq)], dtype=np.int64), op="sum")
    if me == 0:
        if totals[0] != totals[2]:
            raise AssertionError(f"{totals[2]} messages sent but {totals[0]} received")
        print(f"msgstorm OK job={w.size} ranks messages={int(totals[0])} bytes={int(totals[1])}", flush=True)
    w.barrier()


if __name__ == "__main__":
    main()
