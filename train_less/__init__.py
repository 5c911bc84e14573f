"""LESS kernel training (activation capture, per-layer optax training, orbax checkpoints). Populated by the LESS issue."""
