"""Checkpoints of the training loop: atomic save and load (`store`), the per-file hash manifest
and its verification (`manifest`), and the phases a save goes through (`phase`)."""
