"""Chelsea's budget: how many slots ``B_b`` a compressed KV head keeps (Hu et al., 2025, §5.1, §7.2 and App. C.2;
spec §2.9; method note ``docs/notes/chelsea.md`` A12), the sinks and recent window a short prompt's budget leaves
room for, and the slots a head holds after any number of decode steps (Alg. 1, simulated on the host).

Every function works on Python ints, numpy int64 arrays (host plans over every prompt length of a bucket) and
traced int32 arrays ``[B]`` (the state's per-sequence ``target``), with the same integer arithmetic, so host plans
and traced counts agree exactly. ``n``: prompt tokens; ``gamma`` (``Gamma``): the decode steps the cache is built
for; a *rule* is the static tuple :func:`rule` returns.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax.numpy as jnp
import numpy as np

from kvjax.budget import as_fraction, floor_fraction, floor_mul


def rule(budget: float | int, total_heads: int, n_out: int) -> tuple:
    """The static per-head budget rule of the compressed heads (host side, exact integers), for ``budget`` over a
    model of ``total_heads`` KV heads (all layers) of which ``n_out`` are outlier heads paid for by the others:

    - ``("frac", p, q)``: ``B = floor(p (n + Gamma) / q)``; ``p/q`` is ``R`` (:func:`kvjax.budget.as_fraction`)
      or, with outlier heads, ``R_c = (R H - O) / (H - O)`` (A12). ``R_c`` is used exactly when its denominator
      is at most ``MAX_DENOMINATOR`` (10000), else rounded *down* to the 1/10000 grid so that ``floor_mul`` stays
      inside int32 and the budget stays a ceiling;
    - ``("count", c, H, O)``: ``B = c`` (no outliers) or ``floor((c H - O (n + Gamma)) / (H - O))``;
    - ``("all",)``: every KV head is an outlier head: nothing is compressed.
    """
    if n_out >= total_heads:
        return ("all",)
    if isinstance(budget, float):
        p, q = as_fraction(budget)
        if n_out:
            rc = Fraction(p * total_heads - q * n_out, q * (total_heads - n_out))
            if rc <= 0:
                raise ValueError(
                    f"budget={budget} cannot pay for {n_out} full-cache outlier heads of "
                    f"{total_heads} (reallocated fraction {float(rc):.4f} <= 0); raise the budget, "
                    "drop outlier heads or set reallocate=False"
                )
            p, q = floor_fraction(rc)
            if p <= 0:
                raise ValueError(
                    f"budget={budget}: the reallocated fraction for {n_out} outlier heads "
                    "rounds to 0; raise the budget or set reallocate=False"
                )
        return ("frac", p, q)
    return ("count", int(budget), total_heads, n_out)


def target(rule: tuple, n, gamma: int):
    """``B_b``: slots per compressed KV head (sinks and recent included) of a sequence with an ``n``-token prompt
    (Python int, numpy or traced int32 array ``[B]``) under ``rule``, at least 1."""
    full = n + gamma
    if rule[0] == "all":
        t = full
    elif rule[0] == "frac":
        t = floor_mul(full, rule[1], rule[2])
    else:
        c, h, o = rule[1:]
        if o:  # B falls as n grows and is < 1 (clamped to 1) from n + Gamma > c h / o on: clip there first,
            # so that o (n + Gamma) <= c h + o stays inside int32 when traced (c h is a host constant)
            mn = min if isinstance(full, int) else (np.minimum if isinstance(full, np.ndarray) else jnp.minimum)
            full = mn(full, c * h // o + 1)
        t = c if not o else (c * h - o * full) // (h - o)
    if isinstance(n, int):
        return max(t, 1)
    if isinstance(n, np.ndarray):
        return np.broadcast_to(np.maximum(t, 1), n.shape).astype(np.int64)
    return jnp.broadcast_to(jnp.maximum(t, 1), jnp.shape(n)).astype(jnp.int32)


def windows(n_sink: int, n_recent: int, target):
    """Sinks and recent window ``(n_sink_b, n_recent_b)`` under a budget ``target``: the configured ones when
    ``target > n_sink + n_recent``, else shrunk to fit ``target - 1`` slots, the recent window first (the middle
    keeps at least one slot, so every round can merge). Ints, numpy or jnp arrays."""
    mn = np.minimum if isinstance(target, np.ndarray) else (min if isinstance(target, int) else jnp.minimum)
    nr = mn(n_recent, target - 1)
    ns = mn(n_sink, target - 1 - nr)
    return ns, nr


def needs_per_seq_windows(rule: tuple, gamma: int, n_sink: int, n_recent: int, interval: int) -> bool:
    """Does any prompt length (of any bucket) that compresses, in prefill or decode, have a budget of at most
    ``n_sink + n_recent``? Decided from the config and ``Gamma`` only, never from the bucket, so that the same
    prompt takes the same code path (and gives bit-identical merges) in every bucket."""
    k, g = n_sink + n_recent, interval
    if rule[0] == "all":
        return False
    if rule[0] == "count":
        return rule[3] > 0 or rule[1] <= k  # with outliers B_b falls as n grows: assume it may
    n_star = -(-(k + 1) * rule[2] // rule[1])  # B(n) > k for every n >= n_star (B is non-decreasing in n)
    ns = np.arange(n_star + 1, dtype=np.int64)
    tgt = target(rule, ns, gamma)
    active = (ns >= tgt + g) | (tgt + g <= ns + gamma - 1)
    return bool(np.any(active & (tgt <= k)))


def held_slots(rule: tuple, b: int, n: int, steps: int, interval: int) -> int:
    """Slots a compressed KV head with budget ``b`` (:func:`target`) of an ``n``-token prompt holds after ``steps``
    decode steps (Alg. 1 on the host): ``n + steps`` while it has not reached its trigger ``b + g``, ``b`` right
    after every Chelsea call, ``b + (steps since the call)`` in between (always ``< b + g``); ``g = interval``."""
    trig, g = b + interval, interval
    total = n + steps
    if rule[0] == "all":
        return total
    if n >= trig:
        return b + steps % g
    if total < trig:
        return total
    return b + (total - trig) % g


def mean_held(comp: int, total: int, n_out: int, num_kv_heads: int) -> int:
    """The floor of the mean over a layer's ``num_kv_heads`` KV heads of the slots held: ``comp`` for each
    compressed head, ``total`` (every token seen) for each of the layer's ``n_out`` outlier heads."""
    return int(math.floor((comp * (num_kv_heads - n_out) + total * n_out) / num_kv_heads))
