"""A checkpointed job that says which codec and pipeline settings its daemon gave it (issue 18).

Each rank prints ``rank R codec <GANGD_CKPT_CODEC>`` and ``rank R pipeline
<GANGD_CKPT_PIPELINE>`` once it has called
ckpt.init(), then idles in the checkpointed loop (every iteration a
checkpoint candidate) until the file named by its one argument exists: a
test checkpoints, kills and restarts it whenever it is ready, however
loaded the machine is, and a restart prints the codec its ranks got too.
Its state includes 1 MiB of zeros, so a compressed checkpoint has a ratio
to show.
"""

import itertools
import os
import sys
import time

import numpy as np

from gangd import ckptlib as ckpt

release = sys.argv[1]
ckpt.init()
rank = int(os.environ["GANGD_RANK"])
print(f"rank {rank} codec {os.environ.get('GANGD_CKPT_CODEC', '<unset>')}", flush=True)
print(f"rank {rank} pipeline {os.environ.get('GANGD_CKPT_PIPELINE') or '<defaults>'}", flush=True)
state = ckpt.protect("state", {"iterations": 0})
field = ckpt.protect("field", lambda: np.zeros(1 << 17))  # 1 MiB that compresses: ckpt stats shows the codec's ratio
for _ in ckpt.loop(itertools.count()):
    if os.path.exists(release):
        break
    state["iterations"] += 1
    time.sleep(0.01)
