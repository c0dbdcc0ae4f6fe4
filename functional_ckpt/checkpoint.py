"""What the functions on one checkpoint take and return.

``fc.save`` returns a :class:`CheckpointInfo`; ``fc.save_async`` a :class:`PendingSave`
and it stages into a :class:`Stager`'s reusable buffers; ``fc.inspect`` returns a
:class:`CheckpointSummary` of :class:`TensorSpec` leaves in :class:`Node` sub-trees; ``fc.verify`` a
:class:`VerifyReport` of :class:`Problem` lines.
"""

from functional_ckpt._src.restore.summary import CheckpointSummary, Node, TensorSpec
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.staging import PendingSave, Stager
from functional_ckpt._src.storage.verify import Problem, VerifyReport

__all__ = ["CheckpointInfo", "CheckpointSummary", "Node", "PendingSave", "Problem", "Stager"]
__all__ += ["TensorSpec", "VerifyReport"]
