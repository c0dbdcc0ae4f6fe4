"""What the functions on one checkpoint return: ``fc.save`` a :class:`CheckpointInfo`,
``fc.save_async`` a :class:`PendingSave` (staged by a :class:`Stager`), ``fc.inspect`` a
:class:`CheckpointSummary`, ``fc.verify`` a :class:`VerifyReport`."""

from functional_ckpt._src.restore.summary import CheckpointSummary, Node, TensorSpec
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.staging import PendingSave, Stager
from functional_ckpt._src.storage.verify import Problem, VerifyReport

__all__ = ["CheckpointInfo", "CheckpointSummary", "Node", "PendingSave", "Problem", "Stager"]
__all__ += ["TensorSpec", "VerifyReport"]
