"""The checkpoint library linked into jobs (consistent checkpoints arrive in a later release)."""
