"""KeepState FS: durable virtual machines as a filesystem of sessions, checkpoints, forks."""

__version__ = "0.1.0"
