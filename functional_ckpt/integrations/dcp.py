"""DCP's storage seam: ``dcp.save``/``dcp.async_save`` with ``storage_writer=Writer(path)``
commit a checkpoint of this format; ``dcp.load`` with ``storage_reader=Reader(path)``
reads any one, every byte checked, no pickle of ``.metadata``. See docs/integrations.md.
"""

from functional_ckpt._src.dcp.reader import Reader
from functional_ckpt._src.dcp.writer import Writer

__all__ = ["Reader", "Writer"]
