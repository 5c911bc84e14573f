"""The integer-argument check that kvjax, eval, train_less and the kernels share.

It lives here, in the bottom package (``kernels_pallas`` imports none of the others), so that every layer can use
it without an import cycle. One function, one message: ``{name}={value!r} must be an int >= {at_least}``, then
``or None`` where None is allowed, ``(why)`` and ``; fix`` where the caller says what the number is and how to fix
it, e.g. ``window=0 must be an int >= 1 (SnapKV's observation window, e.g. 8)``."""

from __future__ import annotations

import numpy as np


def check_int(
    name: str,
    value,
    why: str = "",
    fix: str = "",
    *,
    at_least: int = 1,
    none_ok: bool = False,
    numpy_ok: bool = False,
) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is an int >= ``at_least`` (1: a positive int).

    A bool is never an int here (``True`` is not a window of 1). ``numpy_ok``: a numpy integer passes too (values
    read from arrays or files); ``none_ok``: ``None`` passes (the caller's default). ``why`` is what the number
    means (shown in parentheses), ``fix`` what to pass instead (after a semicolon)."""
    if value is None and none_ok:
        return
    kinds = (int, np.integer) if numpy_ok else int
    if isinstance(value, bool) or not isinstance(value, kinds) or value < at_least:
        raise ValueError(
            f"{name}={value!r} must be an int >= {at_least}"
            + (" or None" if none_ok else "")
            + (f" ({why})" if why else "")
            + (f"; {fix}" if fix else "")
        )


def is_pow2(x: int) -> bool:
    """Whether ``x`` is a power of two (1, 2, 4, ...): Triton's block dims must be."""
    return x > 0 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
    """The smallest power of two ``>= x`` (1 for ``x <= 1``): a Triton block dim that holds ``x``."""
    return 1 << max(0, (int(x) - 1).bit_length())
