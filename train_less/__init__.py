"""LESS kernel training (paper §3.2): activation capture from the frozen model, per-layer optax training of
φ, ψ with the sparse policy as a parallel mask (data parallel over a mesh's ``data`` axis with ``mesh=``), orbax
checkpoints, and the ``kvjax-train-less`` CLI."""

from train_less.trainer import TrainConfig, train

__all__ = ["TrainConfig", "train"]
