"""An mpi4py program for MPI's name service and what gangd does not serve.

    mpi_names.py publish SERVICE PORT [HOLD] rank 0 publishes, says so, then (given HOLD)
                                             keeps the job alive until the file HOLD exists
    mpi_names.py lookup SERVICE              rank 0 looks it up: "found PORT" or "absent CLASS"
    mpi_names.py unpublish SERVICE           rank 0 unpublishes: "unpublished" or "refused CLASS"
    mpi_names.py publish-many PREFIX N       rank 0 publishes PREFIX0..N-1 until one is refused
    mpi_names.py spawn                       every rank spawns a program that does not exist from COMM_SELF
    mpi_names.py serve SERVICE               Open_port, publish it as SERVICE, Accept over the job's ranks,
                                             Merge (low), an allreduce of rank+1 over the merged ranks:
                                             "served N" (N the sum); then unpublish and close the port
    mpi_names.py connect SERVICE             look SERVICE up, Connect over the job's ranks, Merge (high),
                                             the same allreduce: "connected N"

Error classes are printed by name (MPI_ERR_NAME, MPI_ERR_SERVICE, ...).
"""

import os
import sys
import time

from mpi4py import MPI

CLASSES = {getattr(MPI, n): n for n in dir(MPI) if n.startswith("ERR_") and isinstance(getattr(MPI, n), int)}


def err(exc):
    return "MPI_" + CLASSES.get(exc.Get_error_class(), str(exc.Get_error_class()))


comm = MPI.COMM_WORLD
what = sys.argv[1]
if what == "spawn":
    try:
        MPI.COMM_SELF.Spawn("/nonexistent/gangd-test-program", [], maxprocs=1)
        print(f"{comm.rank}: spawned", flush=True)
    except MPI.Exception as exc:
        print(f"{comm.rank}: spawn failed {err(exc)}: {exc.Get_error_string()}", flush=True)
    comm.Barrier()
elif what == "serve":
    port = MPI.Open_port() if comm.rank == 0 else None
    if comm.rank == 0:
        MPI.Publish_name(sys.argv[2], port)
        print("serving", flush=True)
    inter = comm.Accept(port, root=0)
    merged = inter.Merge(high=False)
    total = merged.allreduce(merged.rank + 1)
    if comm.rank == 0:
        print(f"served {total} over {merged.size} ranks", flush=True)
        MPI.Unpublish_name(sys.argv[2], port)
        MPI.Close_port(port)
    merged.Free()
    inter.Disconnect()
elif what == "connect":
    port = MPI.Lookup_name(sys.argv[2]) if comm.rank == 0 else None
    inter = comm.Connect(port, root=0)
    merged = inter.Merge(high=True)
    total = merged.allreduce(merged.rank + 1)
    if comm.rank == 0:
        print(f"connected {total} over {merged.size} ranks", flush=True)
    merged.Free()
    inter.Disconnect()
elif comm.rank == 0:
    if what == "publish":
        service, port = sys.argv[2:4]
        hold = sys.argv[4] if len(sys.argv) > 4 else None
        try:
            MPI.Publish_name(service, port)
            print("published", flush=True)
        except MPI.Exception as exc:
            print(f"refused {err(exc)}", flush=True)
        while hold is not None and not os.path.exists(hold):  # (the test's cue; gangd's timeout ends it otherwise)
            time.sleep(0.05)
    elif what == "lookup":
        try:
            print("found", MPI.Lookup_name(sys.argv[2]), flush=True)
        except MPI.Exception as exc:
            print(f"absent {err(exc)}", flush=True)
    elif what == "unpublish":
        try:
            MPI.Unpublish_name(sys.argv[2], "")
            print("unpublished", flush=True)
        except MPI.Exception as exc:
            print(f"refused {err(exc)}", flush=True)
    elif what == "publish-many":
        prefix, n = sys.argv[2], int(sys.argv[3])
        for i in range(n):
            try:
                MPI.Publish_name(f"{prefix}{i}", f"port-{i}")
            except MPI.Exception as exc:
                print(f"refused at {i} {err(exc)}", flush=True)
                break
        else:
            print(f"published {n}", flush=True)
if what not in ("spawn", "serve", "connect"):
    comm.Barrier()
