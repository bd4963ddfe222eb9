"""KeepState FS: durable virtual machines shown as a filesystem of sessions, checkpoints and forks."""

__version__ = "0.1.0"
