"""mpi4py.futures under gangd: an MPIPoolExecutor that spawns its workers (tests/test_mpi_spawn.py).

    mpi_futures.py N WORKERS   map x*x over range(N) on WORKERS spawned workers; print the sum and the workers' pids
"""

import os
import sys

from mpi4py.futures import MPIPoolExecutor


def square(x):
    return x * x, os.getpid()


def main():
    n, workers = int(sys.argv[1]), int(sys.argv[2])
    with MPIPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(square, range(n)))
    values = [v for v, _ in results]
    print(f"results {len(values)} sum {sum(values)} in order {values == [x * x for x in range(n)]}", flush=True)
    print(f"workers {len({pid for _, pid in results})}", flush=True)


if __name__ == "__main__":
    main()
