"""An mpi4py program for MPI_Comm_spawn under gangd (tests/test_mpi_spawn.py).

    mpi_spawn.py self N        each rank spawns N children from COMM_SELF; they talk to it
    mpi_spawn.py world N       the ranks of COMM_WORLD spawn N children together (root 0)
    mpi_spawn.py multiple      spawn_multiple: "child a 1" x1 and "child b 2 3" x2
    mpi_spawn.py hold N        spawn N children that print their pid and wait for ever
    mpi_spawn.py crash         spawn 2 children; child rank 1 dies of SIGSEGV
    mpi_spawn.py refused ARGS  spawn "ARGS" (a command, nprocs) and print the error or "spawned"
    mpi_spawn.py after PATH HOST   once PATH exists, spawn 1 child on HOST; it talks to the parent
    mpi_spawn.py on KEY HOSTS N  spawn N children with the info key KEY=HOSTS; print the node
                               each runs on (GANGD_NODE, as gangd gives it) or the error

A child (started by the parent as ``mpi_spawn.py child ...``) reports its
argv, appnum and rank to the parent over the intercommunicator; both sides
then merge it and sum the ranks of the merged communicator with allreduce.
"""

import os
import signal
import sys
import time

from mpi4py import MPI

ME = os.path.abspath(__file__)
PY = sys.executable


def talk_as_parent(inter, merged_high=False):
    if inter.Get_rank() == 0:  # (local rank 0 of the parent group asks each child)
        for child in range(inter.Get_remote_size()):
            inter.send(("hello", child), dest=child, tag=1)
        said = [inter.recv(source=child, tag=2) for child in range(inter.Get_remote_size())]
        for line in said:
            print(f"child says {line}", flush=True)
    merged = inter.Merge(high=merged_high)
    total = merged.allreduce(merged.Get_rank())
    n = merged.Get_size()
    print(f"merged size {n} sum {total} ok {total == n * (n - 1) // 2}", flush=True)
    merged.Free()
    inter.Disconnect()


def child(parent):
    world = MPI.COMM_WORLD
    appnum = MPI.COMM_WORLD.Get_attr(MPI.APPNUM)
    what = parent.recv(source=0, tag=1)
    parent.send(f"{what[0]}-{what[1]} rank {world.rank} of {world.size} appnum {appnum} args {' '.join(sys.argv[2:])}", dest=0, tag=2)
    merged = parent.Merge(high=True)
    merged.allreduce(merged.Get_rank())
    merged.Free()
    parent.Disconnect()


def main():
    what = sys.argv[1]
    world = MPI.COMM_WORLD
    parent = MPI.Comm.Get_parent()
    if what == "child":
        child(parent)
    elif what == "where":
        parent.send(f"rank {world.rank} on {os.environ.get('GANGD_NODE')}", dest=0, tag=4)
        parent.Disconnect()
    elif what == "holder":
        print(f"pid {os.getpid()}", flush=True)
        parent.send(os.getpid(), dest=0, tag=3)
        while True:
            time.sleep(1)
    elif what == "crasher":
        parent.Barrier()
        if world.rank == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        while True:
            time.sleep(1)
    elif what == "self":
        inter = MPI.COMM_SELF.Spawn(PY, [ME, "child", str(world.rank)], maxprocs=int(sys.argv[2]))
        talk_as_parent(inter)
    elif what == "world":
        inter = world.Spawn(PY, [ME, "child", "w"], maxprocs=int(sys.argv[2]), root=0)
        talk_as_parent(inter)
    elif what == "multiple":
        inter = MPI.COMM_SELF.Spawn_multiple([PY, PY], [[ME, "child", "a", "1"], [ME, "child", "b", "2", "3"]], [1, 2])
        talk_as_parent(inter)
    elif what == "hold":
        inter = MPI.COMM_SELF.Spawn(PY, [ME, "holder"], maxprocs=int(sys.argv[2]))
        pids = [inter.recv(source=c, tag=3) for c in range(inter.Get_remote_size())]
        print(f"children {' '.join(map(str, pids))}", flush=True)
        while True:
            time.sleep(1)
    elif what == "crash":
        inter = MPI.COMM_SELF.Spawn(PY, [ME, "crasher"], maxprocs=2)
        inter.Barrier()
        print("children started", flush=True)
        while True:
            time.sleep(1)
    elif what == "refused":
        command, nprocs = sys.argv[2], int(sys.argv[3])
        MPI.COMM_SELF.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            MPI.COMM_SELF.Spawn(command, [], maxprocs=nprocs)
            print("spawned", flush=True)
        except MPI.Exception as exc:
            print(f"spawn failed: {exc.Get_error_string()}", flush=True)
    elif what == "after":
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.1)
        info = MPI.Info.Create()
        info.Set("host", sys.argv[3])
        talk_as_parent(MPI.COMM_SELF.Spawn(PY, [ME, "child", "after"], maxprocs=1, info=info))
    elif what == "on":
        key, hosts, nprocs = sys.argv[2], sys.argv[3], int(sys.argv[4])
        info = MPI.Info.Create()
        info.Set(key, hosts)
        MPI.COMM_SELF.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            inter = MPI.COMM_SELF.Spawn(PY, [ME, "where"], maxprocs=nprocs, info=info)
        except MPI.Exception as exc:
            print(f"spawn failed: {exc.Get_error_string()}", flush=True)
            return
        for child_rank in range(inter.Get_remote_size()):
            print(f"child {inter.recv(source=child_rank, tag=4)}", flush=True)
        inter.Disconnect()


main()
