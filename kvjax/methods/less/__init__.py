"""``less`` (Dong et al., 2024, "Get More with LESS", §3): a learned constant-size low-rank state beside a
sparse eviction policy (H2O or Λ-masking = StreamingLLM).

The sparse policy (:class:`~kvjax.methods.h2o.H2O` or :class:`~kvjax.methods.streaming.StreamingLLM`,
wrapped, not copied) keeps and evicts tokens exactly as on its own, in its fixed slot buffer. Every KV pair
it evicts is folded into a per-KV-head state ``H = Σ ψ(k)ᵀ v`` ``[R, D]`` and ``z = Σ ψ(k)`` ``[R]``
(Eqs. 4-5) before its slot is reused, and each query attends exactly to the cached tokens and through the
learned kernel ``φ(q)·ψ(k)`` to every evicted one, with one shared normaliser (Eq. 3)::

    â = (φ(q) H + Σ_cache exp(q·k/√D) v) / (φ(q) zᵀ + Σ_cache exp(q·k/√D))

computed from the sparse cache's flash partials ``(o, m, l)`` in log space (never overflows; with ``H = 0,
z = 0`` it is bit-for-bit the sparse policy's output). After the full-attention prefill, every prompt token
the policy did not keep goes into ``H, z`` at once (method note ``docs/notes/less.md`` §2.8), ``fold_chunk``
prompt tokens at a time (memory linear in the prompt; the sum is the same up to float rounding). The fold is
linear in the prompt and small beside the prefill attention: ψ of every prompt token (one MLP per token and KV
head, about ``2 D hidden`` multiply-adds) and one rank-``R`` outer product.

A decode step is the wrapped policy's step (H2O: one pass over the live slots' K and V, ``h2o`` module docstring)
plus, once per step and never per slot, ``φ(q)`` of the ``Hq`` query heads, ``ψ(k)`` of the one evicted key per
KV head and the ``H, z`` update: it reads the policy's bytes, ``H, z`` and the kernel weights (``bytes_read_per_step``).

The kernels φ, ψ and their file format are in :mod:`kvjax.methods.less.kernels`; the parallel (masked) form that
training uses, with the policies' eviction masks, in :mod:`kvjax.methods.less.parallel`. Both are re-exported
here.

Einsum axes: b batch, h KV head, g query head within its group, i query position, j/s key position/slot,
r rank, d head dim.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kernels_pallas.checks import check_int
from kvjax.budget import budget_tokens
from kvjax.methods.base import AttendsPrompt, LayerContext, Capacity, Method, SlotCache, tree_bytes
from kvjax.methods.h2o import H2O
from kvjax.methods.streaming import StreamingLLM

from kvjax.methods.less.kernels import (  # noqa: F401  (re-exported: kvjax.methods.less is their public home)
    KERNELS_FILE,
    CONFIG_FILE,
    FORMAT,
    MODEL_KEYS,
    gelu,
    LessKernels,
    module_for,
    init_kernels,
    mlp_phi,
    mlp_psi,
    load_kernels,
    parse_layers,
    format_layers,
    model_identity,
    check_model,
)
from kvjax.methods.less.parallel import (  # noqa: F401  (re-exported)
    synthesize,
    parallel_attention,
    mask_from_evictions,
    h2o_evictions,
    h2o_mask,
    h2o_paper_evictions,
    lambda_evictions,
    lambda_mask,
)

POLICIES = ("h2o", "lambda")
#: LESS's default budget, a fraction of each prompt: the one ``kvjax generate``, ``kvjax-eval`` and the other
#: methods default to, and the one ``kvjax-train-less`` trains at by default (of ``--seq-len``).
DEFAULT_BUDGET = 0.2
#: Parallel H2O masks for training: kvjax's decode semantics, or the paper's (:meth:`Less.eviction_times`).
MASKS = ("decode", "paper")


@struct.dataclass
class LessState:
    """One layer's LESS state: the sparse policy's slot cache plus ``H [B, Hkv, R, D]`` and ``z [B, Hkv, R]``
    (float32), and this layer's kernel params (model weights, shared by the batch; not counted as cache)."""

    sparse: SlotCache
    H: jnp.ndarray
    z: jnp.ndarray
    kernels: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Less(Method, AttendsPrompt):
    """LESS config (static under jit).

    policy: ``"h2o"`` (heavy hitters + recent, ``recent`` as in :class:`H2O`) or ``"lambda"`` (Λ-masking:
    ``sinks`` first tokens + recent, i.e. :class:`StreamingLLM`); budget: the sparse cache's budget (as for
    the wrapped policy). kernels: a ``kvjax-train-less`` output folder, or None for fresh kernels
    (``rank``, ``hidden``, ``seed``; warm-start scale 1e-4, so LESS starts close to the sparse policy).
    phi_fn / psi_fn: feature-map hooks ``fn(kernels, x [B, H, ..., D]) -> [B, H, ..., R]`` replacing the
    MLP (e.g. analytic kernels; ``kernels`` is then whatever pytree the state's ``kernels`` holds).
    strict: with ``kernels``, a policy, budget, recent window or sinks other than those the kernels were
    trained with (``less_config.json``) is a ValueError instead of a warning. A kernels folder whose
    ``layers_trained`` lacks a layer (a ``kvjax-train-less --layers`` run) is an error when that layer is used.
    """

    name: ClassVar[str] = "less"
    why_no_decode_budget: ClassVar[str] = (  # base.Method.why_no_decode_budget
        "less already bounds decode through its evicting policy (h2o or lambda)."
    )
    step_kernels: ClassVar[tuple[str, ...]] = ()  # base.Method.step_kernels
    traced_layer: ClassVar[bool] = True  # scan over layers (base.Method.traced_layer)
    policy: str = "h2o"
    budget: float | int = DEFAULT_BUDGET
    recent: float | int = 0.5
    sinks: int = 4
    kernels: str | None = None
    rank: int = 8
    hidden: int = 512
    seed: int = 0
    phi_fn: Callable | None = None
    psi_fn: Callable | None = None
    fold_chunk: int = 2048  # prompt tokens per step of the prefill fold into H, z (memory, not results)
    strict: bool = False

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is not a LESS sparse policy; choose 'h2o' or 'lambda'")
        check_int("rank", self.rank, numpy_ok=True)
        check_int("hidden", self.hidden, numpy_ok=True)
        check_int("fold_chunk", self.fold_chunk, "prompt tokens per fold step")
        if self.kernels is not None:
            meta, _ = load_kernels(self.kernels)  # fail early: missing files or another format
            self._check_trained(meta.get("policy"), (meta.get("train") or {}).get("seq_len"))
        if not self.sparse.has_decode_partial:  # the declared capability LESS needs (never getattr)
            raise ValueError(f"policy={self.policy!r} does not provide decode_partial; LESS wraps h2o or lambda")

    def _check_trained(self, trained: dict | None, seq_len: int | None = None):
        """Warn (ValueError with ``strict``) when the policy, budget, recent window (H2O) or sinks (Λ) differ
        from those the kernels were trained with (``less_config.json``'s ``policy``). A fractional budget matches
        when it gives the trained token count on the training sequences (``seq_len``): the kernels were trained at
        that fraction."""
        if not trained:
            return
        bad = []
        if self.policy != trained.get("policy"):
            bad.append(f"policy: trained {trained.get('policy')!r}, requested {self.policy!r}")
        elif isinstance(self.budget, float):
            if not (seq_len and int(budget_tokens(self.budget, seq_len)) == trained.get("budget")):
                at = "" if not seq_len else f" of {seq_len}-token sequences"
                bad.append(
                    f"budget: trained {trained.get('budget')} tokens{at}, requested {self.budget} (a fraction of "
                    "each prompt, so the token count varies)"
                )
        elif self.budget != trained.get("budget"):
            bad.append(f"budget: trained {trained.get('budget')}, requested {self.budget}")
        if self.policy == trained.get("policy") == "h2o" and isinstance(trained.get("budget"), int):
            if self.budget == trained["budget"]:  # the same budget: compare the windows in tokens
                want = H2O(budget=trained["budget"], recent=trained.get("recent", 0.5)).recent_tokens(trained["budget"])
                have = self.sparse.recent_tokens(self.budget)
                if have != want:
                    bad.append(
                        f"recent: trained {trained.get('recent')!r} ({want} tokens), requested "
                        f"{self.recent!r} ({have} tokens)"
                    )
            elif self.recent != trained.get("recent"):
                bad.append(f"recent: trained {trained.get('recent')!r}, requested {self.recent!r}")
        if self.policy == trained.get("policy") == "lambda" and self.sinks != trained.get("sinks"):
            bad.append(f"sinks: trained {trained.get('sinks')}, requested {self.sinks}")
        if bad:
            msg = (
                f"kernels={self.kernels!r} were trained for another sparse policy setting: {'; '.join(bad)}. "
                "LESS kernels transfer across settings only approximately; use the trained values, or train "
                "kernels for these (kvjax-train-less)"
            )
            if self.strict:
                raise ValueError(msg + " (strict=True)")
            warnings.warn(msg, stacklevel=3)

    @property
    def sparse(self):
        """The wrapped sparse policy's config."""
        if self.policy == "h2o":
            return H2O(budget=self.budget, recent=self.recent)
        return StreamingLLM(budget=self.budget, sinks=self.sinks)

    @property
    def evicts_before_attending(self) -> bool:
        """Λ overwrites the oldest recent token before attending; H2O attends then evicts (Algorithm 1)."""
        return self.policy == "lambda"

    def _phi(self, kernels, q):
        return (self.phi_fn or mlp_phi)(kernels, q)

    def _psi(self, kernels, k):
        return (self.psi_fn or mlp_psi)(kernels, k)

    def layer_kernels(self, model_cfg, layer: int):
        """This layer's kernel params (loaded and checked, or fresh), as new device arrays."""
        if self.kernels is None:
            key = jax.random.fold_in(jax.random.PRNGKey(self.seed), layer)
            return init_kernels(model_cfg, key, self.rank, self.hidden)
        meta, arrays = load_kernels(self.kernels, model_cfg)
        trained = meta.get("layers_trained")
        if trained is not None and layer not in trained:
            folder = Path(self.kernels)
            hint = (
                f"this is one --layers run; use its parent {str(folder.parent)!r}, where all runs are merged"
                if folder.name.startswith("layers-")
                else f"train the missing ones with kvjax-train-less --layers A-B --out {self.kernels} (its runs merge "
                "into that folder)"
            )
            raise ValueError(
                f"kernels={self.kernels!r} have no trained kernels for layer {layer} (trained layers: "
                f"{format_layers(trained)} of {model_cfg.num_layers}); {hint}"
            )
        return {name: jnp.array(a[layer], dtype=jnp.float32) for name, a in arrays.items()}

    def init(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> LessState:
        kernels = self.layer_kernels(model_cfg, layer)
        r = kernels["q_w2"].shape[-1] if "q_w2" in kernels else self.rank
        h, d = model_cfg.num_kv_heads, model_cfg.head_dim
        return LessState(
            sparse=self.sparse.init(model_cfg, batch, capacity, layer, dtype),
            H=jnp.zeros((batch, h, r, d), jnp.float32),
            z=jnp.zeros((batch, h, r), jnp.float32),
            kernels=kernels,
        )

    @property
    def attends_prompt(self) -> bool:
        """As its policy's (H2O: yes, Λ: no): LESS implements :class:`~kvjax.methods.base.AttendsPrompt` for the
        policies that attend the prompt, and this instance-level flag, not the type, says whether this one does
        (the one capability decided by a method's config)."""
        return self.sparse.attends_prompt

    def prefill(self, state: LessState, layer: int, q, k, v, lengths, previous=None) -> LessState:
        """Full-attention prefill is done by the engine; the policy compresses the prompt and every valid
        prompt token it did not keep is folded into ``H, z`` at once (Eqs. 4-5, note §2.8)."""
        return self._fold_evicted(state, k, v, lengths, self.sparse.prefill(state.sparse, layer, q, k, v, lengths))

    def prefill_attend(self, state: LessState, layer: int, q, k, v, lengths, previous=None):
        """The policy's :meth:`prefill_attend` (the prompt's attention and its scores in one pass), then the fold."""
        out, sparse = self.sparse.prefill_attend(state.sparse, layer, q, k, v, lengths)
        return out, self._fold_evicted(state, k, v, lengths, sparse)

    def _fold_evicted(self, state: LessState, k, v, lengths, sparse) -> LessState:
        """``state`` with the policy's prompt cache ``sparse`` and every valid prompt token it did not keep folded
        into ``H, z``."""
        t = k.shape[2]
        tpos = jnp.arange(t)
        b, h, s = sparse.pos.shape
        # kept [B, Hkv, T] by a scatter of the kept positions (O(slots + T), not an [S, T] comparison)
        kept = (
            jnp.zeros((b, h, t + 1), bool)
            .at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], jnp.where(sparse.pos >= 0, sparse.pos, t)]
            .set(True)[..., :t]
        )
        ev = (tpos[None, None, :] < lengths[:, None, None]) & ~kept
        H, z = self._fold(state.kernels, k, v, ev, state.H, state.z)
        return state.replace(sparse=sparse, H=H, z=z)

    def _fold(self, kernels, k, v, ev, H, z):
        """``H + Σ_t ψ(k_t)ᵀ v_t`` and ``z + Σ_t ψ(k_t)`` over the prompt tokens with ``ev [B, Hkv, T]``
        (Eqs. 4-5), ``fold_chunk`` tokens at a time: memory linear in ``T`` with a small constant (ψ's hidden
        layer is ``[B, Hkv, fold_chunk, hidden]``, never ``[B, Hkv, T, hidden]``)."""
        b, h, t, d = k.shape
        c = min(self.fold_chunk, t)
        n = -(-t // c)
        pad = ((0, 0), (0, 0), (0, n * c - t))
        kc = jnp.pad(k, pad + ((0, 0),)).reshape(b, h, n, c, d)
        vc = jnp.pad(v, pad + ((0, 0),)).reshape(b, h, n, c, v.shape[-1])
        ec = jnp.pad(ev, pad).reshape(b, h, n, c)

        def add(i, carry):
            H, z = carry
            at = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=2, keepdims=False)  # noqa: E731
            psk = jnp.where(at(ec)[..., None], self._psi(kernels, at(kc)), 0.0)  # [B, Hkv, C, R]
            return (H + jnp.einsum("bhtr,bhtd->bhrd", psk, at(vc).astype(jnp.float32)), z + psk.sum(axis=2))

        return jax.lax.fori_loop(0, n, add, (H, z))

    def decode(self, state: LessState, layer: int, q, k, v, pos):
        """Algorithm 1: attend (Eq. 3) over the sparse cache + the new token + ``H, z``; fold the evicted
        pair into ``H, z`` (Eqs. 4-5). q ``[B, Hq, D]``; k, v ``[B, Hkv, D]``; pos ``[B]``."""
        part, sparse, (ek, evv, gone) = self.sparse.decode_partial(state.sparse, layer, q, k, v, pos)
        pe = jnp.where(gone[..., None], self._psi(state.kernels, ek[:, :, None, :])[:, :, 0], 0.0)  # [B,Hkv,R]
        dH = pe[..., :, None] * jnp.where(gone[..., None], evv.astype(jnp.float32), 0.0)[..., None, :]
        H, z = state.H + dH, state.z + pe
        if self.evicts_before_attending:
            out = synthesize(part, self._phi(state.kernels, q), H, z)
        else:
            out = synthesize(part, self._phi(state.kernels, q), state.H, state.z)
        return out, state.replace(sparse=sparse, H=H, z=z)

    def state_axes(self, state: LessState):
        """The sparse part and ``H``, ``z`` are batch- and head-major; the kernels (weights, no batch axis) are
        replicated."""
        axes = super().state_axes(state)
        return axes.replace(sparse=super().state_axes(state.sparse), kernels=jax.tree.map(lambda x: (), state.kernels))

    def memory_bytes(self, state: LessState) -> int:
        """Sparse cache + ``H`` + ``z`` (the kernel weights are model weights, like the LLM's, not cache)."""
        return tree_bytes(state.sparse) + tree_bytes((state.H, state.z))

    def held_overhead_bytes(self, model_cfg, batch: int, capacity: Capacity, layer: int, dtype) -> int:
        """The policy's overhead plus the constant-size part: ``H``, ``z`` and the kernel weights, whose size must
        not depend on the capacity (measured at the smallest one, so a state that grew with the bucket fails)."""
        small = jax.eval_shape(lambda: self.init(model_cfg, batch, Capacity(1, 1), layer, dtype))
        return self.sparse.held_overhead_bytes(model_cfg, batch, capacity, layer, dtype) + tree_bytes(
            (small.H, small.z, small.kernels)
        )

    def bytes_read_per_step(self, state: LessState, num_heads: int) -> int:
        """The sparse policy's step plus ``H, z`` (read and written) and the kernel weights (read)."""
        return (
            self.sparse.bytes_read_per_step(state.sparse, num_heads)
            + 2 * tree_bytes((state.H, state.z))
            + tree_bytes(state.kernels)
        )

    def tokens_held(self, state: LessState):
        """Tokens in the sparse cache (the constant-size ``H, z`` state is counted in bytes, not tokens)."""
        return self.sparse.tokens_held(state.sparse)

    def min_budget(self) -> tuple[int, str]:
        return self.sparse.min_budget()

    def held(self, n: int, steps: int, ctx: LayerContext = LayerContext()) -> int:
        return self.sparse.held(n, steps, ctx)

    # -- the parallel (training) form of this config ------------------------------------------------------
    def eviction_times(self, q, k, mask: str = "decode"):
        """``[B, Hkv, S]`` int32: the row at which the sparse policy, run token by token from an empty cache,
        evicts each token (``S``: never); :func:`mask_from_evictions` makes the mask. ``budget`` must be a
        token count. mask (H2O only): ``"decode"``, kvjax's decode semantics (:func:`h2o_evictions`, decode =
        the parallel form) or ``"paper"``, the paper's parallel mask (:func:`h2o_paper_evictions`)."""
        if isinstance(self.budget, float):
            raise ValueError(f"budget={self.budget} is a fraction; the parallel form needs a token count (int)")
        if mask not in MASKS:
            raise ValueError(f"mask={mask!r} is not a parallel H2O mask; choose one of {MASKS}")
        b, hkv, s = k.shape[:3]
        if self.policy == "h2o":
            fn = h2o_evictions if mask == "decode" else h2o_paper_evictions
            return fn(q, k, self.budget, self.sparse.recent_tokens(self.budget))
        if self.budget <= self.sinks:
            raise ValueError(f"budget={self.budget} must exceed sinks={self.sinks} for the lambda policy")
        return jnp.broadcast_to(lambda_evictions(s, self.budget, self.sinks), (b, hkv, s))

    def parallel_mask(self, q, k, mask: str = "decode"):
        """``[B, Hkv, S, S]`` bool mask of the sparse policy for a sequence generated token by token from an
        empty cache (:meth:`eviction_times`)."""
        return mask_from_evictions(self.eviction_times(q, k, mask))
