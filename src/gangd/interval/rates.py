"""Each node's failure rate, from the cluster's own history of node losses with a prior from the config.

Why a prior: a young cluster has seen no node loss, and "no loss in three days" does not mean λ = 0 (an
interval of infinity). Paper 002 reads each host's rate from a table the administrator writes; gangd keeps
that table as the prior (``[interval]``'s host → MTBF, "30d") and lets the history of node losses recorded
in etcd take over as it accumulates.

The estimate is the posterior mean of a Gamma-Poisson model: with a Gamma(w, w·M₀) prior on λ (w
pseudo-failures in w·M₀ seconds: mean 1/M₀) and k losses seen in E seconds of exposure,

    λ = (w + k) / (w·M₀ + E)

which is the average of the prior's rate 1/M₀ and the history's k/E weighted by w·M₀ and E seconds: the
prior counts as w MTBFs of history. So it *is* the prior until the cluster has watched the node for a
time comparable to w·M₀, and the history's own k/E once it has watched it for much longer -- "the prior
until the history says enough", without a threshold at which the estimate jumps.

The job's rate is the sum over its nodes (paper 002: the job stops when any of its hosts fails).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Rate", "node_rate", "job_rate", "parse_duration", "format_span"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# ASCII digits only: Python's float() and \d also take other scripts' digits and "1_000", which a
# config file should not; no sign, no exponent, no inf/nan.
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([smhd]?)", re.ASCII)
_DURATION_MAX_CHARS = 64


@dataclass(frozen=True)
class Rate:
    """One node's (or any set of nodes') failure rate.

    ``lam``: failures per second; ``mtbf``: 1/lam seconds (inf when lam is 0); ``basis``: a short English
    phrase for ``gang nodes`` saying where it came from, e.g. ``"prior: MTBF 30d (config)"`` or
    ``"history: 2 losses in 5.1d + prior 30d"``.
    """

    lam: float
    mtbf: float
    basis: str

    def __post_init__(self) -> None:
        if not (isinstance(self.lam, float | int) and math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"a failure rate must be a finite number ≥ 0 per second, not {self.lam!r}")
        if not (isinstance(self.mtbf, float | int) and not math.isnan(self.mtbf) and self.mtbf > 0):
            raise ValueError(f"an MTBF must be > 0 seconds, not {self.mtbf!r}")


def _number(name: str, value: float, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '≥ 0'}, not {value!r}")
    return float(value)


def node_rate(losses: int, exposure: float, prior_mtbf: float, prior_weight: float = 1.0) -> Rate:
    """The posterior-mean failure rate of a node that lost ``losses`` times in ``exposure`` seconds watched.

    ``prior_mtbf`` (seconds, > 0) is the config's MTBF for the node; ``prior_weight`` (> 0) is how many
    failures' worth of evidence the prior counts as (see the module docstring). Negative, NaN, infinite or
    non-numeric inputs (and a bool for ``losses``) raise ValueError.
    """
    if isinstance(losses, bool) or not isinstance(losses, int) or losses < 0:
        raise ValueError(f"losses must be a whole number ≥ 0, not {losses!r}")
    exposure = _number("exposure", exposure, positive=False)
    prior_mtbf = _number("prior_mtbf", prior_mtbf, positive=True)
    prior_weight = _number("prior_weight", prior_weight, positive=True)
    lam = (prior_weight + losses) / (prior_weight * prior_mtbf + exposure)
    if losses == 0 and exposure == 0:
        basis = f"prior: MTBF {format_span(prior_mtbf)} (config)"
    else:
        basis = f"history: {losses} loss{'' if losses == 1 else 'es'} in {format_span(exposure)} + prior {format_span(prior_mtbf)}"
    return Rate(lam=lam, mtbf=1 / lam, basis=basis)


def job_rate(rates: Iterable[Rate]) -> float:
    """λ of a job: the sum of its nodes' rates (any node's failure stops the job; 0 for no nodes)."""
    return math.fsum(rate.lam for rate in rates)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"1.5d"`` or ``"3600"``.

    Units s, m, h, d (case-insensitive, optionally after a space); no unit means seconds. Anything else --
    a sign, an exponent, inf/nan, other scripts' digits, another unit, more than 64 characters -- raises
    ValueError naming the text. (gangd's CLI has a click ``Duration`` type for ``--ckpt-every``; it lives in
    the client, which the daemon must not import, so the config's MTBF values are parsed here.)
    """
    if not isinstance(text, str):
        raise ValueError(f"a duration must be text such as 30d, 12h, 90m or 45s, not {text!r}")
    if len(text) > _DURATION_MAX_CHARS:
        raise ValueError(f"a duration of {len(text)} characters is not a duration (examples: 30d, 12h, 90m, 45s)")
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a duration (examples: 30d, 12h, 90m, 45s, 1.5d, 3600)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_span(seconds: float) -> str:
    """A span in the largest unit it reaches, 2 significant digits below 10 of it: 30d, 5.1d, 12h, 1.5h (not 90m), 45s."""
    if math.isinf(seconds):
        return "inf"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.2g}{unit}" if seconds / size < 10 else f"{seconds / size:.0f}{unit}"
    return f"{seconds:.2g}s" if seconds < 10 else f"{seconds:.0f}s"
