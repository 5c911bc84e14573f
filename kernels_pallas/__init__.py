"""Pallas kernels, each beside its pure-JAX reference (DESIGN principle 7). Populated by the kernel issues."""
