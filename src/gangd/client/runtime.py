"""The job side: what a rank learns from gangd's environment.

gangd starts every rank with ``GANGD_JOB``, ``GANGD_RANK``, ``GANGD_SIZE``,
``GANGD_NODE`` and ``GANGD_SOCKET`` (its node daemon's socket). Outside
gangd the same code sees a one-rank job, so a program runs unchanged under
``python app.py`` and under ``gang run``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class JobInfo:
    job: int | None
    rank: int
    size: int
    node: str | None
    socket: str | None

    @property
    def under_gangd(self) -> bool:
        return self.job is not None


def job_info(environ: Mapping[str, str] = os.environ) -> JobInfo:
    job = environ.get("GANGD_JOB")
    return JobInfo(
        job=int(job) if job else None,
        rank=int(environ.get("GANGD_RANK", 0)),
        size=int(environ.get("GANGD_SIZE", 1)),
        node=environ.get("GANGD_NODE"),
        socket=environ.get("GANGD_SOCKET"),
    )
