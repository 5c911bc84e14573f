"""Fidelity probes for any method: how far its cache takes each layer's attention from the full cache's.

The model runs teacher-forced over ``prompt + probes`` tokens with full attention (so every method sees the
same per-layer q/k/v). In every layer each method compresses the prompt's K/V with its own ``prefill``, then
attends for the ``probes`` following tokens with its own ``decode``; the full method does the same. Measured:

- ``rel_error``: ``||o_method - o_full|| / ||o_full||`` of the attention outputs (before the output
  projection), averaged over probes and query heads, per layer;
- ``recall``: of the ``k`` prompt tokens that full attention weights most for the first probe query (softmax
  over the prompt, mean over each KV head's query group; ``k`` = the tokens the method keeps for that KV head,
  window included, at least 1), the fraction the method's cache holds after prefill, per layer (methods whose
  state has a ``pos`` leaf of original positions: full, streaming_llm, h2o, snapkv, pyramidkv, chunkkv;
  ``None`` for the others, e.g. chelsea (merges), pqcache and quest (retrieve per step: see ``topb_recall``), less);
- ``topb_recall``: for recall methods (``method.recalls``: pqcache, clusterkv, quest;
  ``None`` for the others) the recall of important tokens of ClusterKV's Fig. 11 (method note
  ``docs/notes/clusterkv.md`` §4.1): before each decode probe, the positions the method would attend
  (``method.selected_positions`` of its state at that step: sinks, window, retrieved tokens) are restricted to
  the prompt; with ``B`` = their count for a query head, the score is ``|selected ∩ topB(q · K_prompt)| / B``,
  ``topB`` the ``B`` prompt tokens with the largest exact logits of that step's query for that head
  (:func:`topb_recall`). Averaged over query heads and over *all* ``probes`` decode steps (each query against
  the state it really decodes with, as the paper averages over steps), per layer. 1.0 = the method attended
  exactly the top-B prompt tokens (e.g. a budget covering every token, or pqcache's ``dense_short`` fallback);
  decoded tokens are left out of both sets;
- ``jaccard``: Jaccard of the kept prompt positions between adjacent layers (the ChunkKV paper's Table 2
  measure, :func:`kvjax.analysis.adjacent_layer_jaccard`), window included.

>>> res = probe(model, ids, methods.get("snapkv", budget=0.2), probes=8)
>>> res["rel_error"], res["recall"], res["jaccard"]          # lists over layers / adjacent layer pairs
>>> probe(model, ids, methods.get("pqcache", budget=0.2))["topb_recall"]   # [L] per-layer top-B recall
>>> topb_recall(selected, q, k, n)                          # [B, Hq] for any mask (jit-friendly)

``FidelityTask`` runs it from ``kvjax-eval fidelity`` on essay prompts of ``--lengths`` tokens.

On a sharded model (``model.mesh``) the probe runs under the mesh: parameters tensor-parallel and the
per-head operations (``top_k``, kernels) split over ``model`` (:func:`kvjax.sharding.per_head`). A probe is one
prompt, so ``data`` does not split it (each ``data`` replica computes the same probe).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.checks import check_int
from kvjax import analysis, engine
from kvjax.loading import assets
from kvjax import model as M
from kvjax import sharding as S
from kvjax.methods.base import Capacity
from kvjax.methods.plans.hybrid import Window
from kvjax.methods.plans.layers import method_of, same_as_previous


def _layer(method, layer: int, state, previous, q, k, v, n: int, probes: int, recalls: bool = False):
    """One layer: ``method.prefill`` over the first ``n`` tokens, then ``method.decode`` for the ``probes``
    next ones. Returns (state after prefill, outputs ``[P, B, Hq, D]``, top-B recall ``[P, B, Hq]`` or None).
    ``previous`` (the previous layer's prefill state) is passed only to methods that read it (ChunkKV's index
    reuse). For a recall method, before each step the positions it would attend
    (``method.selected_positions`` of the state at that step) are scored against the exact top-B of that step's
    query over the prompt keys (:func:`topb_recall`); ``recalls``: the plan's flag (a recall method's full layers
    run ``full``, whose selection is every stored position)."""
    lengths = jnp.full((q.shape[0],), n, jnp.int32)
    extra = {"previous": previous} if method.reuses_previous_layer else {}
    state = method.prefill(state, layer, q[:, :, :n], k[:, :, :n], v[:, :, :n], lengths, **extra)

    def step(st, i):
        qi = q[:, :, n + i]
        rec = topb_recall(method.selected_positions(st, layer, qi), qi, k[:, :, :n], n) if recalls else None
        o, st = method.decode(st, layer, qi, k[:, :, n + i], v[:, :, n + i], jnp.full((1,), n + i))
        return st, (o, rec)

    _, (outs, recs) = jax.lax.scan(step, state, jnp.arange(probes))
    return state, outs, recs


def full_weights(q, k, n: int) -> jnp.ndarray:
    """Softmax weights ``[B, Hkv, n]`` float32 of the first probe query (position ``n``) over the prompt's keys,
    mean over each KV head's query group."""
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    qg = q[:, :, n].reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, k[:, :, :n].astype(jnp.float32)) / jnp.sqrt(jnp.float32(d))
    return jax.nn.softmax(s, axis=-1).mean(axis=2)


def topb_recall(selected, q, k, n) -> jnp.ndarray:
    """``[B, Hq]`` float32: per query head, ``|selected ∩ topB(q · K)| / B`` over the prompt positions
    ``[0, n)`` (ClusterKV Fig. 11's recall of important tokens; jit-friendly, boolean masks).

    selected: ``[B, Hq, S]`` bool, the positions a recall method attends (``Method.selected_positions``; columns
    from ``n`` on -- decoded tokens, padding -- are ignored, ``S`` may exceed ``T``); q: ``[B, Hq, D]`` one query
    per head; k: ``[B, Hkv, T, D]`` keys (``T >= n``; query head ``i`` reads KV head ``i // (Hq / Hkv)``); n: the
    prompt length, an int or ``[B]``. ``B`` is the number of prompt positions selected for that head and
    ``topB`` the ``B`` prompt positions with the largest exact logits ``q · k`` (float32; ties go to the lower
    position), so 1.0 means the method picked exactly the top-B attention tokens (softmax is monotone: the
    top-B logits are the top-B weights). A head that selects no prompt position scores 1.0 (nothing missed)."""
    selected, q, k = jnp.asarray(selected, bool), jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if selected.shape[-1] < t:
        raise ValueError(
            f"selected has {selected.shape[-1]} positions, fewer than the {t} keys; pass the mask "
            "over at least the prompt positions"
        )
    qg = q.reshape(b, hkv, hq // hkv, d)
    logits = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision=jax.lax.Precision.HIGHEST).reshape(b, hq, t)
    prompt = (jnp.arange(t)[None, :] < jnp.broadcast_to(jnp.asarray(n), (b,))[:, None])[:, None, :]  # [B, 1, T]
    sel = selected[..., :t] & prompt
    order = jnp.argsort(jnp.where(prompt, -logits, jnp.inf), axis=-1, stable=True)  # descending, ties: lower
    rank = jnp.argsort(order, axis=-1)  # rank of each position
    count = sel.sum(-1)  # B per head
    hit = (sel & (rank < count[..., None])).sum(-1)
    return jnp.where(count > 0, hit / jnp.maximum(count, 1), 1.0).astype(jnp.float32)


@functools.lru_cache(maxsize=16)
def _probe_fn(cfg, method, n: int, probes: int, dtype, mesh=None):
    """jit(params, tokens [1, n + probes]) -> per layer (full outputs, method outputs, method state, weights,
    top-B recall ``[P, 1, Hq]`` or None), the whole model in one compiled function (teacher-forced with full
    attention, as the engine's prefill); traced under ``mesh`` (:func:`kvjax.sharding.tracing`) when given."""
    # on a model with sliding-window layers both run as the engine plans them: a local layer's reference and method
    # are its ring buffer of the window (kvjax.methods.plans.hybrid), so the probes measure the global layers' methods
    method, full = engine.as_run(cfg, method), engine.as_run(cfg, "full")
    cap, recalls, compressed = Capacity(n, probes + 1), method_of(method).recalls, compressed_layers(cfg, method)

    def run(params, tokens):
        with S.tracing(mesh):
            return body(params, tokens)

    def body(params, tokens):
        positions = jnp.arange(tokens.shape[1])[None]

        def attend(layer, x, q, k, v, out):
            m = method.at(layer)  # the layer's method (a per-layer plan's full layers run full)
            prev = out[-1][2] if same_as_previous(method, layer) else None
            f = full.at(layer)
            _, ref, _ = _layer(f, layer, f.init(cfg, 1, cap, layer, dtype), None, q, k, v, n, probes)
            # a local layer's ring buffer is the model's own attention, not the recall method: no top-B there
            rec_here = recalls and layer in compressed
            st, o, rec = _layer(m, layer, m.init(cfg, 1, cap, layer, dtype), prev, q, k, v, n, probes, rec_here)
            attn = M.causal_attention(q, k, v, None, cfg.sliding_windows[layer])
            return attn, out + [(ref, o, st, full_weights(q, k, n), rec)]

        _, out = M.run_layers(cfg, params, M.embed(params, tokens, cfg), positions, attend, [])
        return out

    return jax.jit(run)


def topk_recall(weights: np.ndarray, kept: np.ndarray) -> float:
    """Mean over (batch, KV head) of ``|top_k(weights) ∩ kept| / k`` with ``k = |kept|`` (at least 1).

    weights: ``[B, H, n]``; kept: ``[B, H, n]`` bool. Ties in ``weights`` go to the lower position.
    """
    out = []
    for w, m in zip(weights.reshape(-1, weights.shape[-1]), kept.reshape(-1, kept.shape[-1])):
        k = max(int(m.sum()), 1)
        top = np.argsort(-w, kind="stable")[:k]
        out.append(m[top].sum() / k)
    return float(np.mean(out))


def probe(model, ids, method, probes: int = 8) -> dict:
    """Fidelity of ``method`` against the full cache on one prompt ``ids`` (its last ``probes`` tokens are the
    decode probes). Returns ``{"rel_error": [L], "recall": [L] | None, "jaccard": [L-1] | None,
    "topb_recall": [L] | None, "compressed_layers", "tokens_held", "cache_bytes", "kib_per_seq"}`` (the memory of
    the method's cache after prefill, one sequence; ``topb_recall`` for recall methods only, see the module docstring,
    None on a hybrid model's local layers; ``compressed_layers``: the layers not kept as a local window)."""
    cfg, params = model.config, model.params
    method = engine.as_run(cfg, method)  # a hybrid model: ring buffers on its local layers (kvjax.methods.plans.hybrid)
    recall_method = method_of(method).recalls
    check_int("probes", probes, numpy_ok=True)
    n = len(ids) - probes
    if n < 2:
        raise ValueError(f"a prompt of {len(ids)} tokens leaves {n} tokens before {probes} probes; use a longer one")
    if len(ids) > cfg.max_position_embeddings:
        raise ValueError(f"{len(ids)} tokens exceed the model's context of {cfg.max_position_embeddings}")
    per_layer = _probe_fn(cfg, method, n, probes, model.dtype, model.mesh)(params, jnp.asarray([ids], jnp.int32))
    errors, recalls, states, topb = [], [], [], []
    for ref, o, st, weights, rec in per_layer:
        ref, o = np.asarray(ref, np.float64), np.asarray(o, np.float64)
        num = np.linalg.norm(o - ref, axis=-1)
        errors.append(float(np.mean(num / np.maximum(np.linalg.norm(ref, axis=-1), 1e-12))))
        states.append(st)
        if hasattr(st, "pos") and not recall_method:  # a recall method stores every token: see topb_recall
            kept = analysis.mask_from_states([st], np.asarray([n]), n).mask[0]
            recalls.append(topk_recall(np.asarray(weights), kept))
        # mean over probes and query heads; None on a local layer (its window, not the method)
        topb.append(None if rec is None else float(np.mean(np.asarray(rec, np.float64))))
    # Every layer must hold kept positions (quest's full first layers are slot caches, the others are not).
    has_pos = all(hasattr(st, "pos") for st in states) and not recall_method
    jac = None
    if has_pos and len(states) > 1:
        jac = [float(j) for j in analysis.adjacent_layer_jaccard(analysis.mask_from_states(states, np.asarray([n]), n))]
    held = float(engine.tokens_held(method, states)[0])
    cache = engine.memory_bytes(method, states)
    return {
        "rel_error": errors,
        "compressed_layers": compressed_layers(cfg, method),
        "recall": recalls if has_pos else None,
        "jaccard": jac,
        "topb_recall": topb if recall_method else None,
        "tokens_held": held,
        "cache_bytes": cache,
        "kib_per_seq": cache / 1024,
    }


def compressed_layers(cfg, method) -> list[int]:
    """The layers where ``method`` (as :func:`kvjax.engine.as_run` runs it on ``cfg``) is the method, not a hybrid
    model's local :class:`~kvjax.methods.plans.hybrid.Window` ring buffer."""
    return [layer for layer in range(cfg.num_layers) if not isinstance(method.at(layer), Window)]


def _mean_over(per_layer: list | None, layers: list[int]) -> float | None:
    """The mean of a per-layer list over ``layers`` (the ones the method compresses: a hybrid model's local layers
    keep their window, equal to full's, and would only dilute it); None when not measured."""
    return None if per_layer is None else float(np.mean([per_layer[layer] for layer in layers]))


def essay_prompt(model, length: int, offset: int = 0) -> list[int]:
    """``length`` consecutive token ids of the embedded Paul Graham essays (from ``offset``)."""
    if model.tokenizer is None:
        raise ValueError("the fidelity task needs a model loaded with its tokenizer")
    ids = model.tokenizer.encode(assets.essays_text())
    if offset + length > len(ids):
        raise ValueError(f"length={length} (+ offset {offset}) exceeds the essays' {len(ids)} tokens")
    return list(ids[offset : offset + length])


@dataclasses.dataclass(frozen=True)
class FidelityTask:
    """``kvjax-eval fidelity``: one row per (method, budget, prompt length) with the per-layer probes;
    ``score`` = the mean relative attention error over the layers the method compresses (``compressed_layers``:
    every layer but a hybrid model's local ones, which keep their window); ``recall_mean`` and ``topb_recall_mean``
    over the same layers, ``jaccard_mean`` over all adjacent pairs (None where not measured; the report's extra
    columns)."""

    lengths: tuple[int, ...] = (1024,)
    probes: int = 8
    name = "fidelity"

    def prepare(self, model):
        return None, [[essay_prompt(model, n)] for n in self.lengths]

    def run_batch(self, model, method, prepared, batch, meta) -> list[dict]:
        rows = []
        for ids in batch:
            res = probe(model, ids, method, self.probes)
            rows.append(
                {
                    **meta,
                    "length": len(ids),
                    "probes": self.probes,
                    **res,
                    "recall_mean": _mean_over(res["recall"], res["compressed_layers"]),
                    "jaccard_mean": None if res["jaccard"] is None else float(np.mean(res["jaccard"])),
                    "topb_recall_mean": _mean_over(res["topb_recall"], res["compressed_layers"]),
                    "score": _mean_over(res["rel_error"], res["compressed_layers"]),
                }
            )
        return rows
