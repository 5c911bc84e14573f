"""The budget contract, in one place: what a budget is, how it is parsed, and how many tokens it gives.

A budget is either

- a **fraction** ``b`` (a Python float in ``(0, 1]``): each sequence keeps ``ceil(b * n)`` tokens of its own
  prompt of ``n`` tokens (at least one, never more than ``n``). It is relative to the sequence's own length,
  never to the prompt bucket (the bucket is a compile-time shape, not a semantic); or
- a **token count** (a Python int ``>= 1``).

Arithmetic is exact integer arithmetic. ``b`` is taken as the decimal it is written as (``0.3`` is 3/10, not the
binary float ``0.29999999999999998890``): :func:`as_fraction` gives ``p/q`` with ``q <= MAX_DENOMINATOR``
(fractions with more than four decimal places are rounded *down* to the nearest ``1/MAX_DENOMINATOR``, so the
budget stays a ceiling). :func:`budget_tokens` then computes ``ceil(p n / q)`` as
``(n // q) p + ceil((n % q) p / q)``, which never overflows int32 for any ``n < 2^31`` (``(n % q) p < q^2``), on
Python ints (static sizes) and on traced int32 arrays (per-sequence budgets inside ``jit``) alike.

:func:`parse_budget` is the one parser of the ``--budget`` / ``--budgets`` options of ``kvjax``, ``kvjax-eval``
and ``kvjax-train-less``: ``"0.2"`` is a fraction, ``"256"`` a token count.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import jax.numpy as jnp
import numpy as np

#: Largest denominator of a fractional budget (4 decimal places are exact).
MAX_DENOMINATOR = 10_000

Budget = float | int


def check_budget(budget, name: str = "budget", max_tokens: int | None = None) -> Budget:
    """``budget`` unchanged if it is a legal budget, else a ValueError naming ``name``, the value and the fix.

    Legal: a float in (0, 1] (a fraction of each prompt) or an int >= 1 (tokens; at most ``max_tokens`` when
    given, e.g. the model context). Bools, NaN, 0, negatives and floats above 1 are refused.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(
            f"{name}={budget!r} must be a fraction in (0, 1] (a float, e.g. 0.2) or a token count "
            ">= 1 (an int, e.g. 256)"
        )
    if isinstance(budget, float):
        if math.isnan(budget) or not 0.0 < budget <= 1.0:
            raise ValueError(
                f"{name}={budget} as a fraction must be in (0, 1], e.g. 0.2; pass an int (e.g. 256) for a token count"
            )
        return budget
    if budget < 1:
        raise ValueError(f"{name}={budget} tokens must be >= 1; pass e.g. 256, or a float in (0, 1] for a fraction")
    if max_tokens is not None and budget > max_tokens:
        raise ValueError(
            f"{name}={budget} tokens exceeds the model context of {max_tokens} tokens; pass at most "
            f"{max_tokens}, or a fraction in (0, 1]"
        )
    return int(budget)


def parse_budget(text: str) -> Budget:
    """``"0.2"`` -> 0.2 (fraction), ``"256"`` -> 256 (tokens); a ValueError naming the option otherwise.

    Used as an argparse ``type=`` by every CLI (argparse turns the ValueError into a usage error)."""
    s = str(text).strip()
    try:
        value: Budget = int(s)
    except ValueError:
        try:
            value = float(s)
        except ValueError:
            raise ValueError(
                f"--budget {text!r} is not a number; use a fraction like 0.2 or a token count like 256"
            ) from None
    return check_budget(value, name="--budget")


def budget_text(budget: Budget) -> str:
    """How a budget is shown in tables and logs: a token count as an integer (``256``, ``1``), a fraction with a
    decimal point (``0.2``, ``1.0``), so the whole prompt (``1.0``) never reads as one token (``1``)."""
    if isinstance(budget, float):
        text = f"{budget:g}"
        return text if any(c in text for c in ".en") else text + ".0"
    return str(budget)


def parse_budgets(text: str) -> list[Budget]:
    """Comma-separated budgets (``"0.2,0.5,256"``) for ``--budgets``."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"--budgets {text!r} is empty; pass e.g. 0.2,0.5 or 256,512")
    return check_distinct([parse_budget(p) for p in parts])


def check_distinct(budgets: list[Budget], name: str = "--budgets") -> list[Budget]:
    """``budgets`` unchanged if no two are equal, else a ValueError naming ``name``. Runs over several budgets
    key their results by the budget's value, where ``1`` (one token) equals ``1.0`` (the whole prompt): the two
    cannot share one run, and a repeated budget would run twice under one key."""
    seen: dict = {}
    for b in budgets:
        if b in seen:
            if type(seen[b]) is type(b):
                raise ValueError(f"{name} lists {budget_text(b)} twice; pass each budget once")
            raise ValueError(
                f"{name} lists both 1 (one token) and 1.0 (the whole prompt), which compare equal where results "
                "are keyed by budget; run them separately"
            )
        seen[b] = b
    return budgets


def floor_fraction(f: Fraction, max_denominator: int = MAX_DENOMINATOR) -> tuple[int, int]:
    """``(p, q)`` of ``f >= 0``: exact when its denominator is at most ``max_denominator``, else rounded *down*
    to the ``1/MAX_DENOMINATOR`` grid (so a budget built from it stays a ceiling)."""
    if f.denominator > max_denominator:
        f = Fraction(math.floor(f * MAX_DENOMINATOR), MAX_DENOMINATOR)
    return f.numerator, f.denominator


def as_fraction(budget: float) -> tuple[int, int]:
    """``(p, q)``: the fraction ``budget`` as written, ``q <= MAX_DENOMINATOR`` (rounded down beyond that)."""
    return floor_fraction(Fraction(repr(float(budget))))


def ceil_mul(n, p: int, q: int):
    """``ceil(n p / q)`` exactly, for ``0 <= p <= q <= MAX_DENOMINATOR`` and int or int32-array ``n >= 0``."""
    return (n // q) * p + ((n % q) * p + q - 1) // q


def floor_mul(n, p: int, q: int):
    """``floor(n p / q)`` exactly (same ranges as :func:`ceil_mul`)."""
    return (n // q) * p + ((n % q) * p) // q


def budget_tokens(budget: Budget, n, cap=None):
    """Tokens a sequence of ``n`` tokens keeps under ``budget``: ``ceil(b n)`` for a fraction, the count for an
    int; at least ``min(1, n)`` and at most ``cap`` (default ``n``: a budget never asks for more tokens than
    exist). ``n`` is a Python int or an int array (``[B]``, traced or not); the result has the same kind.

    Methods that evict during decode pass ``cap = n + generated`` so a token count can cover generated tokens.
    """
    cap = n if cap is None else cap
    if isinstance(n, (int, np.integer)) and isinstance(cap, (int, np.integer)):
        n, cap = int(n), int(cap)
        t = ceil_mul(n, *as_fraction(budget)) if isinstance(budget, float) else budget
        return max(min(t, cap), min(1, n))
    xp = np if isinstance(n, np.ndarray) and not isinstance(cap, jnp.ndarray) else jnp  # numpy in, numpy out
    n64 = n.astype(np.int64) if xp is np else n
    t = ceil_mul(n64, *as_fraction(budget)) if isinstance(budget, float) else xp.full_like(n64, budget)
    t = xp.maximum(xp.minimum(t, cap), xp.minimum(1, n64))
    return t.astype(np.int64 if xp is np else jnp.int32)


#: Fewest tokens any evicting budget can use sensibly: a budget of 1-2 tokens keeps no context worth the name.
MIN_TOKENS = 3


class BudgetWarning(UserWarning):
    """A budget leaves a sequence fewer tokens than its method can use sensibly (:func:`warn_small_budget`)."""


_warned: set = set()


def warn_small_budget(method, lengths, max_new_tokens: int = 0, model_cfg=None) -> bool:
    """Warn (:class:`BudgetWarning`, once per method config) when ``method``'s budget keeps fewer tokens of a
    prompt than the method can use sensibly: ``method.kept_tokens(n) < min(n, method.min_budget())`` for a prompt
    length ``n`` of ``lengths`` (host ints; call it outside ``jit``). The minimum is the method's own (sinks +
    window, a chunk, a page; at least :data:`MIN_TOKENS`); ``budget=1.0`` (the whole prompt) never warns.
    Methods without a budget (``full``) never warn. Returns whether it warned."""
    budget = method.budget  # declared by every method (base.Method.budget: None without one)
    if budget is None or not lengths:
        return False
    need, why = method.min_budget()
    kept_n = [(method.kept_tokens(int(n), max_new_tokens, model_cfg), int(n)) for n in lengths]
    short = [(k, n) for k, n in kept_n if k < min(n, need)]
    key = (method.name, repr(method))  # once per method config (repr: hashable whatever its fields hold)
    if not short or key in _warned:
        return False
    _warned.add(key)
    kept, n = min(short)
    kind = "a fraction" if isinstance(budget, float) else "an int: a token count"
    fix = (
        f"Use a budget of at least {need} tokens (a fraction >= {math.ceil(100 * need / n) / 100:g} of this "
        "prompt), or 1.0 to keep the whole prompt"
        if need <= n
        else "The prompt is shorter than that: use 1.0 to keep the whole prompt, or a longer prompt"
    )
    warnings.warn(
        f"{method.name}: budget={budget} ({kind}) keeps {kept} token{'s' * (kept != 1)} of a {n}-token "
        f"prompt, fewer than the {need} {method.name} can use sensibly ({why}); the answer may be "
        f"nonsense. {fix}",
        BudgetWarning,
        stacklevel=3,
    )
    return True


class FullAttentionWarning(BudgetWarning):
    """At the size asked for, a compressing method computes exactly full attention (:func:`warn_full_attention`)."""


def warn_full_attention(method, model_cfg, capacity, layers=None, stacklevel: int = 3, plan=None) -> bool:
    """Warn (:class:`FullAttentionWarning`, once per method config and capacity) when ``method`` computes exactly
    full attention in a cache built for ``capacity``: every one of ``layers`` (default: all the model's) runs
    ``full`` (ClusterKV's and Quest's ``n_full`` first layers) or attends every token
    (:meth:`kvjax.methods.base.Method.attends_everything`: too few tokens to compress). Methods that are ``full``
    never warn. Host-side, at ``init`` (static sizes only); ``stacklevel`` as ``warnings.warn``'s, from the caller of
    the function that calls this one. ``plan``: the per-layer plan ``method`` runs under, whose ``at(layer)`` says
    which method runs each layer (default: ``method``'s own ``at``). Returns whether it warned."""
    if method.name == "full" or (isinstance(method.budget, float) and method.budget == 1.0):
        return False  # full, or a budget of the whole prompt: asked for
    plan = method if plan is None else plan
    key = ("full attention", method.name, repr(plan), capacity)
    if key in _warned:
        return False
    whole = layers is None
    layers = list(range(model_cfg.num_layers)) if whole else list(layers)
    if whole:
        _warned.add(key)  # the whole model is checked once; the layers' own init then stays quiet
    first_full = [l for l in layers if plan.at(l).name == "full"]
    own = [l for l in layers if plan.at(l).name == method.name]
    if not layers or len(first_full) + len(own) < len(layers):
        return False
    if not all(plan.at(l).attends_everything(model_cfg, capacity, l) for l in own):
        return False
    _warned.add(key)
    if own:
        why = (
            f"a {capacity.prompt_len}-token prompt and {capacity.max_new_tokens} new tokens are too few to compress; "
            "use a longer prompt or a smaller budget to test its compression"
        )
    else:
        why = "every layer is one of its full first layers (n_full or full_layers); use a model with more layers"
    warnings.warn(
        f"{method.name}: this configuration computes exactly full attention on its {len(layers)} "
        f"layer{'s' * (len(layers) != 1)}, its outputs are full's: {why}",
        FullAttentionWarning,
        stacklevel=stacklevel,
    )
    return True


__all__ = [
    "Budget",
    "BudgetWarning",
    "FullAttentionWarning",
    "MAX_DENOMINATOR",
    "MIN_TOKENS",
    "as_fraction",
    "budget_tokens",
    "ceil_mul",
    "check_budget",
    "floor_fraction",
    "floor_mul",
    "parse_budget",
    "parse_budgets",
    "warn_full_attention",
    "warn_small_budget",
]
