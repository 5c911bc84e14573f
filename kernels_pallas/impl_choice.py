"""How a kernel's ``impl=None`` is resolved: an environment variable naming the implementation wins, else the
backend decides (each kernel package keeps its own variable, tuple of implementations and backend table)."""

from __future__ import annotations

import os


def env_impl(var: str, impls: tuple[str, ...]) -> str | None:
    """The implementation named by the environment variable ``var`` (None when unset or empty); a name not in
    ``impls`` is a ValueError naming the variable, its value and the allowed names."""
    env = os.environ.get(var)
    if not env:
        return None
    if env not in impls:
        raise ValueError(f"{var}={env!r} must be one of {impls} (or unset to choose by backend)")
    return env
