"""Evaluation harness (tasks, metrics, fidelity probes, reports)."""
