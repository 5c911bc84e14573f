"""Which parametrized cases the default run takes and which it leaves to CI's second line (marker ``extended``).

The default run (``python3 -m pytest -q -n 2 --dist loadfile``) keeps its time budget (about 25 minutes on 2
cores, docs/testing.md) by running a test that repeats per method for :data:`REPRESENTATIVES` only; ``.ci/run``'s
second line (``-m extended --extended``) runs the rest, so CI checks every method. A method added to the registry
joins the default run where it brings a behaviour none of them has (:func:`kvjax.methods.cover`)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvjax import methods

#: full, H2O (attends the prompt at prefill), ChunkKV (reuses the previous layer's indices), Chelsea (re-compresses
#: while decoding), PQCache (recalls): the first method of each combination of those behaviours.
REPRESENTATIVES = methods.cover("recalls", "recompresses", "attends_prompt", "reuses_previous_layer")


def cases(values: Iterable, default: Iterable) -> list:
    """``values`` as pytest params: those in ``default`` unmarked, the others marked ``extended``."""
    default = set(default)
    return [pytest.param(v, marks=() if v in default else pytest.mark.extended) for v in values]


def methods_params(names: Iterable[str] | None = None) -> list:
    """The registered method names (or ``names``) as params, :data:`REPRESENTATIVES` in the default run."""
    return cases(methods.names() if names is None else names, REPRESENTATIVES)


#: a test that loops over the methods itself runs them in two groups: the representatives by default, the others in
#: CI's second line
GROUPS = ("representatives", "others")


def group(which: str) -> list[str]:
    """The registered methods of one of :data:`GROUPS`, in registry order."""
    return [n for n in methods.names() if (n in REPRESENTATIVES) == (which == "representatives")]
