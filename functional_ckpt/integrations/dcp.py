"""DCP's storage seam: ``torch.distributed.checkpoint`` writing and reading this format.

``dcp.save(sd, storage_writer=Writer(path))`` (and ``dcp.async_save``, thread or
process mode) commits a checkpoint of this format, atomically and durably, every
byte checksummed; ``dcp.load(sd, storage_reader=Reader(path))`` reads one (any
checkpoint of this format, however written) with every byte checked and no
pickle of ``.metadata``. See docs/integrations.md.
"""

from functional_ckpt._src.dcp.reader import Reader
from functional_ckpt._src.dcp.writer import Writer

__all__ = ["Reader", "Writer"]
