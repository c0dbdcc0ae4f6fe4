"""The remote tier: checkpoints copied to an object store (any fsspec URL) in the background."""
