"""gangd: a parallel operating system for Linux clusters.

* :mod:`gangd.protocol` — the wire format, sans-I/O
* :mod:`gangd.daemon` — the node daemon (``gangd``)
* :mod:`gangd.client` — the ``gang`` command, the Python API and the job-side runtime
* :mod:`gangd.ckptlib` — the library linked into jobs for checkpoints
"""

__version__ = "0.1.0"
