"""A bounded, concurrent stage pipeline for writing and restoring checkpoints (issue 18, paper 004).

Compressing a checkpoint and then writing it costs the sum of the two;
running capture, compression and writing as concurrent stages costs about
the longest one. This package is that engine, independent of the block
format and the codecs, which plug in as stage functions:

* :mod:`.settings` -- buffer count, buffer size, aggregation size, workers of a
  parallel stage, validated;
* :mod:`.ring` -- the fixed pool of buffers between two stages (Empty -> Busy
  -> Ready), the only queue and the memory bound;
* :mod:`.emit` -- packing items into buffers (aggregation of small items,
  whole buffers for the writer);
* :mod:`.engine` -- threads (several for a parallel stage such as compression,
  handing on in order), ordering, failure and cancellation, statistics;
* :mod:`.stages` -- transform, write, read ranges, place into an array.

Dependencies run one way: settings, stats <- ring <- emit <- engine <- stages.
"""

from __future__ import annotations

from .engine import Pipeline, PipelineCancelled, PipelineError, Source, Stage
from .settings import Settings, SettingsError
from .stages import Landing, Place, ReadRanges, Transform, Write
from .stats import StageStats

__all__ = ["Pipeline", "PipelineError", "PipelineCancelled", "Stage", "Source", "Settings", "SettingsError",
           "Transform", "Write", "Landing", "ReadRanges", "Place", "StageStats"]
