"""Layer 3, the host ledger: sessions, lineages, gapless event logs, checkpoint and fork records,
and reconciliation with the in-guest transcript. Pure synchronous Python on the chunk store's
LMDB environment; it never imports trio, pyfuse3, libvirt or click. See docs/ledger.md.
"""

from ksfs.ledger.checkpoints import auto_checkpoint_name
from ksfs.ledger.ledger import Ledger
from ksfs.ledger.reconcile import OUTCOMES, TranscriptInfo, decide_reconcile
from ksfs.ledger.records import BODY_MAX, CheckpointSummary, LineageInfo

__all__ = [
    "BODY_MAX",
    "OUTCOMES",
    "CheckpointSummary",
    "Ledger",
    "LineageInfo",
    "TranscriptInfo",
    "auto_checkpoint_name",
    "decide_reconcile",
]
