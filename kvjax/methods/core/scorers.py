"""Token scorers: which prompt tokens matter, separate from which to keep (docs/interface.md#scorers-and-selection).

A scorer maps the prompt's post-RoPE ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]`` and ``lengths [B]`` to scores
``[B, Hkv, T]`` float32 (larger is kept; GQA: aggregated over each KV group's query heads as the mean). The
selection methods (``snapkv``, ``pyramidkv``, ``chunkkv``) take any scorer, as kvpress's ``ChunkKVPress(press)``
wraps any press: ``methods.get("chunkkv", scorer="h2o")``.

- ``snapkv`` (:class:`WindowScorer`, SnapKV §4.2 Alg. 1): softmax of the last ``window`` real queries over all
  keys, summed over those queries, pooled with a 1-D kernel (``kernel=1``: no pooling). Only prefix votes
  (positions before ``prefix_end``, which the selector always keeps after) are pooled, so kept-window votes do
  not leak into the prefix.
- ``h2o`` (:class:`AccumulatedScorer`, H2O §3): column sums of the causal softmax of every real prompt query.

A scorer joins :data:`SCORERS` with :func:`register_scorer` (a class decorator, as ``kvjax.methods.register`` for
methods), so a plugin adds one by name: ``methods.get("snapkv", scorer="mine")``.

At decode time (a decode budget, :mod:`kvjax.methods.core.bounded`) a scorer ranks the held slots from a ring of the
most recent queries (:meth:`Scorer.observed`, then :meth:`Scorer.finish` in position order): the window scorer's
votes of its last ``window`` queries, pooled as at prefill; the accumulated scorer's sum over the same ring (its
accumulation over every query is not kept during decode).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kernels_pallas.checks import check_int
from kvjax.methods.base import check_registrable
from kvjax.methods.core.select import accumulated_scores, observed_votes, pool1d, window_scores


class Scorer(abc.ABC):
    name: ClassVar[str] = ""

    @abc.abstractmethod
    def __call__(self, q, k, lengths, prefix_end) -> jnp.ndarray:
        """Scores ``[B, Hkv, T]`` float32; ``prefix_end [B]``: positions ``>= prefix_end`` are kept anyway."""

    def observed(self, q_obs, q_pos, k, k_pos) -> jnp.ndarray:
        """Scores ``[B, Hkv, S]`` float32 of the held slots ``k [B, Hkv, S, D]`` (positions ``k_pos [B, Hkv, S]``,
        -1 empty) from the recent queries ``q_obs [B, Hq, W, D]`` at positions ``q_pos [B, W]`` (-1 empty): what
        a decode-time re-compression ranks by (:mod:`kvjax.methods.core.bounded`). Default: the queries' softmax over
        the held keys they may see (``k_pos <= q_pos``), summed over the queries, mean over each KV group
        (:func:`~kvjax.methods.core.select.observed_votes`); then :meth:`finish` on the slots in position order."""
        return observed_votes(q_obs, q_pos, k, k_pos)

    def finish(self, votes, prefix_end) -> jnp.ndarray:
        """The scores from raw votes ``[N, H, S]`` (slots in position order; ``prefix_end [N]``, the kept window
        from there on): pooling for the window scorer, nothing by default."""
        return votes


@dataclasses.dataclass(frozen=True)
class WindowScorer(Scorer):
    name: ClassVar[str] = "snapkv"
    window: int = 8
    kernel: int = 5
    pool: str = "avg"

    def __post_init__(self):
        check_int("window", self.window, "the observation window, e.g. 8")
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel={self.kernel!r} must be an odd int >= 1 (1 disables pooling)")
        if self.pool not in ("avg", "max"):
            raise ValueError(f"pool={self.pool!r} must be 'avg' or 'max'")

    def __call__(self, q, k, lengths, prefix_end):
        return self.finish(window_scores(q, k, lengths, self.window), prefix_end)

    def finish(self, votes, prefix_end):
        if self.kernel == 1:
            return votes
        s = jnp.where(jnp.arange(votes.shape[-1]) < prefix_end[:, None, None], votes, 0.0)
        return pool1d(s, self.kernel, self.pool)


@dataclasses.dataclass(frozen=True)
class AccumulatedScorer(Scorer):
    name: ClassVar[str] = "h2o"
    chunk: int = 512

    def __call__(self, q, k, lengths, prefix_end):
        return accumulated_scores(q, k, lengths, self.chunk)


#: The registered scorers, by name (:func:`register_scorer`): the built-in ones, then those a plugin adds.
SCORERS: dict[str, type] = {}


def register_scorer(cls: type) -> type:
    """Add the scorer class ``cls`` (a frozen dataclass subclassing :class:`Scorer` with a ``name``) to
    :data:`SCORERS` and return it, so it works as a class decorator, as :func:`kvjax.methods.register` does for
    methods: then ``methods.get("snapkv", scorer=cls.name)`` (any method with a ``scorer`` option) builds it with the
    options it shares with the method (``window``, ``kernel``, ``pool``; its other fields at their defaults).
    ValueError for a class that is not one, or a name another class already holds."""
    check_registrable(cls, Scorer, "kvjax.methods.core.scorers.Scorer", SCORERS, "register_scorer", "scorer")
    SCORERS[cls.name] = cls  # the same class loaded again (a plugin file run twice) replaces itself
    return cls


register_scorer(WindowScorer)
register_scorer(AccumulatedScorer)


def check_scorer(scorer) -> None:
    """ValueError unless ``scorer`` is a :class:`Scorer` instance or a registered name (:data:`SCORERS`)."""
    if not isinstance(scorer, Scorer) and not (isinstance(scorer, str) and scorer in SCORERS):
        raise ValueError(
            f"scorer={scorer!r} must be one of {', '.join(SCORERS)} or a Scorer instance (a plugin registers its own "
            "with kvjax.methods.core.scorers.register_scorer)"
        )


def make_scorer(scorer, window: int, kernel: int = 5, pool: str = "avg") -> Scorer:
    """A scorer from a registered name (:data:`SCORERS`: ``"snapkv"`` with the method's ``window``/``kernel``/
    ``pool``, ``"h2o"``, or a plugin's, built with those of the method's options it declares as fields) or a
    :class:`Scorer` instance (used as is)."""
    if isinstance(scorer, Scorer):
        return scorer
    check_scorer(scorer)
    cls = SCORERS[scorer]
    shared = {"window": window, "kernel": kernel, "pool": pool}
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in shared.items() if k in fields})
