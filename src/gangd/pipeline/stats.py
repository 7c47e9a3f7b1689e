"""What each stage did with its time: the numbers ``gang ckpt stats`` and the bench print.

A pipeline is as fast as its slowest stage (paper 004: total ~ 1.02x the
longest stage), so the useful question after a slow checkpoint is which
stage was busy and which were waiting -- for input (the stage before is the
bottleneck) or for a free buffer (the stage after is). Wall times are
measured around the ring hand-offs only (two clock reads per buffer, not per
item); ``cpu_s`` is the stage thread's own CPU time, which is what the
engine's overhead is judged by on a shared machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StageStats:
    name: str
    items_in: int = 0
    bytes_in: int = 0
    items_out: int = 0
    bytes_out: int = 0
    wall_s: float = 0.0  # from the stage's start to its end
    idle_in_s: float = 0.0  # waiting for the stage before to hand over a buffer
    idle_out_s: float = 0.0  # waiting for the stage after to free a buffer
    cpu_s: float = 0.0  # this stage's threads' CPU time (every worker's, for a parallel stage)
    workers: int = 1  # threads that ran the stage (idle times are then the workers' mean, so busy_s is one worker's)

    @property
    def busy_s(self) -> float:
        return max(0.0, self.wall_s - self.idle_in_s - self.idle_out_s)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "busy_s": self.busy_s}
