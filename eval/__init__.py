"""Evaluation harness (tasks, metrics, fidelity probes, reports). Populated by the evaluation issue."""
