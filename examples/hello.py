"""Every rank says where it runs: `gang run -n 8 -- python examples/hello.py`."""

import os
import socket

from gangd.client.runtime import job_info

info = job_info()
print(f"hello from rank {info.rank} of {info.size} in job {info.job} on node {info.node} "
      f"(host {socket.gethostname()}, pid {os.getpid()})")
