"""LESS kernel training (paper §3.2): activation capture from the frozen model streamed to disk in shards,
per-layer optax training of φ, ψ with the sparse policy as a parallel mask (query-chunked: memory linear in the
sequence length; data parallel over a mesh's ``data`` axis with ``mesh=``; a subset of layers per run, merged
into one kernels folder), orbax checkpoints (mid-epoch, bit-exact resume, corrupt-checkpoint fallback), and the
``kvjax-train-less`` CLI."""

from train_less.trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
