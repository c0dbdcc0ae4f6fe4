"""One answer to "are we distributed?": this process's rank and its world."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Where this process stands: its rank, the world size, and whether a group exists."""

    rank: int = 0
    world: int = 1
    initialized: bool = False  # a default process group exists (possibly of one rank)

    @property
    def distributed(self) -> bool:
        """More than one rank saves and restores together (collectives are needed)."""
        return self.world > 1

    @property
    def coordinator(self) -> bool:
        """The rank that checks destinations and commits."""
        return self.rank == 0


def topology() -> Topology:
    """The current process's :class:`Topology` (rank 0 of 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Topology(dist.get_rank(), dist.get_world_size(), True)
    return Topology()


def is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "_local_tensor")
