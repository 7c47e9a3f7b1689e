"""The ``gang`` command, the Python API to the daemons and the job-side runtime."""
