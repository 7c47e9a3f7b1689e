"""Jobs for the network-context tests.

    netctx.py send GATE_FILE   rank 0 sends the MESSAGES to rank 1; rank 1 receives
                               them only once GATE_FILE exists (until then they
                               are in flight), checks them, prints `received OK`
    netctx.py restored         rank 1 receives the MESSAGES without anybody
                               sending them (they come from the restored network
                               context), checks them, prints `restored OK`
    netctx.py exit-early       rank 1 exits at once; rank 0 keeps sending to it
                               and must get comm.PeerExited (prints it, exits 3)
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from gangd import comm

MESSAGES = [
    (0, b""),
    (1, b"ten bytes!"),
    (2, np.arange(250, dtype=np.int32)),
    (3, {"a pickled": "object", "n": 42}),
    (4, np.arange(3 << 20, dtype=np.uint8).reshape(3, -1)),
]


def check(w) -> None:
    for tag, want in MESSAGES:
        got, status = w.recv(source=0, tag=comm.ANY, status=True)
        assert status.tag == tag, (status.tag, tag)
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), tag
        else:
            assert got == want, (got, want)


def main() -> None:
    mode = sys.argv[1]
    w = comm.world()
    if mode == "send":
        gate_file = sys.argv[2]
        if w.rank == 0:
            for tag, obj in MESSAGES:
                w.send(obj, 1, tag=tag)
            print("sent", flush=True)
        else:
            while not os.path.exists(gate_file):
                time.sleep(0.05)
            check(w)
            print("received OK", flush=True)
        w.barrier()
    elif mode == "restored":
        if w.rank == 1:
            check(w)
            print("restored OK", flush=True)
        w.barrier()
    elif mode == "exit-early":
        if w.rank == 1:
            return
        try:
            for i in range(100000):
                w.send(np.zeros(1 << 16, dtype=np.uint8), 1, tag=i % 100)
        except comm.PeerExited as exc:
            print(f"PeerExited: {exc}", flush=True)
            sys.exit(3)
        print("no error after 100000 sends", flush=True)


if __name__ == "__main__":
    main()
