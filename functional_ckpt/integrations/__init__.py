"""Adapters for the training frameworks users already run, one module per client.

Each module imports its client (Lightning, transformers, accelerate, torchdata)
itself, so ``import functional_ckpt`` never loads any of them; import the one you
use: ``from functional_ckpt.integrations.lightning import FunctionalCheckpointIO``.
"""
