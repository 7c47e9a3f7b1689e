"""The job `gang demo` runs: each rank integrates its slice of 4/(1+x^2) over [0,1].

The integral is pi. Every rank prints its partial sum; the demo adds them up.
"""

import os
import sys
import time

from gangd.client.runtime import job_info


def main(steps: int = 4_000_000) -> None:
    info = job_info()
    h = 1.0 / steps
    start = time.perf_counter()
    total = 0.0
    for i in range(info.rank, steps, info.size):
        x = (i + 0.5) * h
        total += 4.0 / (1.0 + x * x)
    partial = total * h
    took = time.perf_counter() - start
    print(f"rank {info.rank:2d} on {info.node}: partial={partial!r} ({took:.2f} s, pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4_000_000)
