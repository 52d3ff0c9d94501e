"""Checkpoints on disk: the tensor inventory a config implies (inventory.py), the validated streaming loader and
the shard writer (files.py), tiny checkpoints in the real format (tiny.py, `mtp-tiny-checkpoint`)."""
