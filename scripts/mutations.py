"""Mutation check: does the test suite catch a broken method, kernel reference, model or budget?

Each mutant below is one small semantic change (a dropped bias or scale, an off-by-one window, a top-k that keeps
the worst, an un-accumulated score, ...). The script copies the repository's files (``git ls-files``: tracked and
untracked-but-not-ignored, so uncommitted work is checked too) into a scratch directory, applies one mutant at a
time there, runs the mutant's test files with ``python3 -m pytest -x -q -p no:cacheprovider`` (``PYTHONPATH`` the
copy, so the copy's ``kvjax`` is imported, not an installed one), records ``killed`` (a test failed), ``survived``
(all passed) or ``timeout``, the first failing test and the seconds, and restores the file. The original snippet
must occur exactly once in its file, else the script stops with an error: a refactor that moves the code makes
the check fail loudly instead of silently testing nothing.

A mutant marked ``equivalent`` changes no output (the note says why); it is run and reported, and expected to
survive. Every other mutant must be killed.

    python3 scripts/mutations.py                      # every mutant (about 17 min on 2 cores)
    python3 scripts/mutations.py --subset ci          # a fixed handful of fast ones (about 1.5 min)
    python3 scripts/mutations.py --only chelsea-no-log-bias,h2o-unaccumulated
    python3 scripts/mutations.py --list               # ids, files, descriptions
    python3 scripts/mutations.py --only ... --tests tests/kvjax/test_chelsea.py::test_decode_outputs_match_reference
    python3 scripts/mutations.py --out benchmarks/results/mutations.json   # + mutations.md beside it

Exit status: 0 when every non-equivalent mutant was killed (and no equivalent one was), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    replacement: str
    tests: tuple[str, ...]  # pytest arguments: files or node ids
    description: str
    k: str | None = None  # a pytest -k selection (where a file is slow)
    equivalent: str | None = None  # why the mutant changes no output (expected to survive)


M = Mutant
T_CHELSEA = ("tests/kvjax/test_chelsea.py",)
T_DECODE_ATT = ("tests/kernels_pallas/test_decode_attention.py", "tests/kernels_pallas/test_decode_attention_xla.py")
T_PARITY = ("tests/kvjax/test_parity.py", "tests/kvjax/test_engine.py")
T_BASE = ("tests/kvjax/test_baselines.py",)
T_BOUNDED = ("tests/kvjax/test_bounded.py",)
K_BOUNDED = "recompression or threshold"  # the reference tests, not the engine's long runs
K_BUDGET = "mul or exact or trap or overflow or four_decimals or counts"  # the arithmetic tests of the budget file

MUTANTS: tuple[Mutant, ...] = (
    # ---- Chelsea (kvjax/methods/chelsea/) ----------------------------------------------------------------------
    M(
        "chelsea-no-log-bias",
        "kvjax/methods/chelsea/attend.py",
        "bias = jnp.log(jnp.where(valid, n, 1.0))",
        "bias = jnp.zeros_like(n)",
        T_CHELSEA,
        "decode attends without the log N bias of merged slots (Eq. 2)",
    ),
    M(
        "csm-count-not-updated",
        "kvjax/methods/chelsea/csm.py",
        "return pick(k, k_new), pick(v, v_new), pick(n, count)",
        "return pick(k, k_new), pick(v, v_new), pick(n, n)",
        T_CHELSEA,
        "a merged slot keeps its old count (counts not added on merge)",
    ),
    M(
        "csm-unweighted-destination",
        "kvjax/methods/chelsea/csm.py",
        'total = rows_at(nb[..., None] * xb, lead, na[..., None] * xa, "add")',
        'total = rows_at(xb, lead, na[..., None] * xa, "add")',
        T_CHELSEA,
        "the merge weighs the destination B slot by 1 instead of its count",
    ),
    M(
        "chelsea-trigger-off-by-one",
        "kvjax/methods/chelsea/__init__.py",
        "need = length >= state.target + self.interval",
        "need = length > state.target + self.interval",
        T_CHELSEA,
        "decode re-compresses at B + g + 1 held slots instead of B + g",
    ),
    M(
        "csm-merges-overshoot",
        "kvjax/methods/chelsea/csm.py",
        "m = xp.minimum(xp.maximum(floor_mul(mid, r_q, RATIO_UNIT), 1), length - budget)",
        "m = xp.minimum(xp.maximum(floor_mul(mid, r_q, RATIO_UNIT), 1), length - budget + 1)",
        T_CHELSEA,
        "a round's merge cap is one past the budget (compresses to B - 1)",
    ),
    M(
        "chelsea-budget-rounded-up",
        "kvjax/methods/chelsea/budget.py",
        "t = floor_mul(full, rule[1], rule[2])",
        "t = -(-full * rule[1] // rule[2])",
        T_CHELSEA,
        "B = ceil(R (n + Gamma)) instead of floor (the budget is no longer a ceiling)",
    ),
    M(
        "chelsea-outlier-misses-new-token",
        "kvjax/methods/chelsea/attend.py",
        "ovalid = jnp.broadcast_to(jnp.arange(ko.shape[2])[None, None, :] <= pos[:, None, None], ko.shape[:3])",
        "ovalid = jnp.broadcast_to(jnp.arange(ko.shape[2])[None, None, :] < pos[:, None, None], ko.shape[:3])",
        T_CHELSEA,
        "an outlier head (full cache) does not attend the new token itself",
    ),
    M(
        "chunked-similarity-ab-swapped",
        "kernels_pallas/chunked_similarity/reference.py",
        "return kc[..., 0, :], kc[..., 1, :], vc[..., 0], vc[..., 1]",
        "return kc[..., 1, :], kc[..., 0, :], vc[..., 1], vc[..., 0]",
        ("tests/kernels_pallas/test_chunked_similarity.py",) + T_CHELSEA,
        "A tokens at odd offsets, B at even ones (the bipartition swapped)",
    ),
    M(
        "chunked-similarity-worst-match",
        "kernels_pallas/chunked_similarity/reference.py",
        "s = jnp.where(va[..., :, None] & vb[..., None, :], s, -jnp.inf)",
        "s = jnp.where(va[..., :, None] & vb[..., None, :], -s, -jnp.inf)",
        ("tests/kernels_pallas/test_chunked_similarity.py",) + T_CHELSEA,
        "each A token's edge goes to its least similar B token",
    ),
    # ---- decode attention: reference and XLA path --------------------------------------------------------------
    M(
        "decode-ref-no-scale",
        "kernels_pallas/decode_attention/reference.py",
        'sc = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))\n'
        "    if bias",
        'sc = jnp.einsum("bhgd,bhsd->bhgs", qg, k, preferred_element_type=jnp.float32)\n    if bias',
        T_DECODE_ATT,
        "the reference's scores lose 1/sqrt(D)",
    ),
    M(
        "decode-ref-length-mask-ignored",
        "kernels_pallas/decode_attention/reference.py",
        "mask = mask & (slots[None, None, :] < jnp.asarray(lengths, jnp.int32)[:, None, None])",
        "mask = mask & (slots[None, None, :] >= 0 * jnp.asarray(lengths, jnp.int32)[:, None, None])",
        T_DECODE_ATT,
        "the reference ignores lengths (attends slots past the fill count)",
    ),
    M(
        "decode-ref-merge-sum",
        "kernels_pallas/decode_attention/reference.py",
        "return oa * ca[..., None] + ob * cb[..., None], m, la * ca + lb * cb",
        "return oa * ca[..., None] + ob * cb[..., None], m, la + lb",
        T_DECODE_ATT + ("tests/kvjax/test_h2o_step.py",),
        "merging two partials adds their sums without rescaling to the common max",
    ),
    M(
        "decode-xla-no-scale",
        "kernels_pallas/decode_attention/xla.py",
        "qg = q.reshape(b, hkv, g, d)\n    scale = 1.0 / np.sqrt(np.float32(d))\n    chunk = chunk or",
        "qg = q.reshape(b, hkv, g, d)\n    scale = 1.0\n    chunk = chunk or",
        T_DECODE_ATT,
        "the XLA decode attention (every method's CPU path) loses 1/sqrt(D)",
    ),
    M(
        "decode-xla-bias-dropped",
        "kernels_pallas/decode_attention/xla.py",
        "s = s + add[:, :, None, :].astype(jnp.float32)",
        "s = s + 0 * add[:, :, None, :].astype(jnp.float32)",
        T_DECODE_ATT,
        "the XLA decode attention drops the additive bias",
    ),
    M(
        "decode-xla-gqa-interleaved",
        "kernels_pallas/decode_attention/xla.py",
        "qg = q.reshape(b, hkv, g, d)\n    scale = 1.0 / np.sqrt(np.float32(d))\n    chunk = chunk or",
        "qg = q.reshape(b, g, hkv, d).transpose(0, 2, 1, 3)\n    scale = 1.0 / np.sqrt(np.float32(d))\n"
        "    chunk = chunk or",
        T_DECODE_ATT,
        "GQA groups interleaved: query head i attends KV head i % Hkv instead of i // G",
    ),
    M(
        "pallas-tpu-decode-no-rescale",
        "kernels_pallas/decode_attention/pallas_tpu.py",
        "o_ref[...] = alpha * o_ref[...] + pv",
        "o_ref[...] = o_ref[...] + pv",
        ("tests/kernels_pallas/test_decode_attention.py",),
        "the TPU kernel (interpret mode) does not rescale its output accumulator when the running max grows",
        k="pallas",
    ),
    M(
        "pallas-gpu-decode-sum-not-rescaled",
        "kernels_pallas/decode_attention/pallas_gpu.py",
        "return alpha[:, None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=1)",
        "return alpha[:, None] * o + pv, m_new, l + jnp.sum(p, axis=1)",
        ("tests/kernels_pallas/test_decode_attention.py",),
        "the GPU kernel (interpret mode) does not rescale its running sum when the running max grows",
        k="pallas or gpu",
    ),
    M(
        "pallas-gpu-decode-output-not-rescaled",
        "kernels_pallas/decode_attention/pallas_gpu.py",
        "return alpha[:, None] * o + pv, m_new, alpha * l + jnp.sum(p, axis=1)",
        "return o + pv, m_new, alpha * l + jnp.sum(p, axis=1)",
        ("tests/kernels_pallas/test_decode_attention.py",),
        "the GPU kernel (interpret mode) does not rescale its output accumulator when the running max grows",
        k="pallas or gpu",
    ),
    # ---- the model --------------------------------------------------------------------------------------------
    M(
        "rope-decode-position-off-by-one",
        "kvjax/engine/core.py",
        "cfg, plan(cfg, method), params, M.embed(params, token[:, None], cfg), pos[:, None], states, step, mesh",
        "cfg, plan(cfg, method), params, M.embed(params, token[:, None], cfg), pos[:, None] + 1, states, step, mesh",
        ("tests/kvjax/test_engine.py",),
        "a decode step's RoPE position is one past the token's",
    ),
    M(
        "rope-all-positions-shifted",
        "kvjax/model/decoder.py",
        "cos, sin = cos_sin(rope, cfg.head_dim, positions, x.dtype)",
        "cos, sin = cos_sin(rope, cfg.head_dim, positions + 1, x.dtype)",
        ("tests/kvjax/test_engine.py",),
        "every RoPE position (prompt and decode) shifted by one",
        equivalent="RoPE scores depend only on the distance between query and key positions, which a common shift "
        "keeps; outputs change only by float rounding (tests/kvjax/test_engine.py, transformers' generate included, "
        "passes)",
    ),
    M(
        "rope-rotation-reversed",
        "kvjax/model/rope.py",
        "return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)",
        "return jnp.concatenate([x[..., half:], -x[..., :half]], axis=-1)",
        ("tests/kvjax/test_parity.py",),
        "rotate_half with the wrong sign (RoPE rotates backwards)",
    ),
    M(
        "rmsnorm-sum-not-mean",
        "kvjax/model/decoder.py",
        "xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)",
        "xf = xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)",
        ("tests/kvjax/test_parity.py",),
        "RMSNorm divides by the root of the sum of squares, not of their mean",
    ),
    M(
        "rmsnorm-weight-dropped",
        "kvjax/model/decoder.py",
        "return weight * xf.astype(x.dtype)",
        "return xf.astype(x.dtype)",
        ("tests/kvjax/test_parity.py",),
        "RMSNorm ignores its weight",
    ),
    M(
        "prefill-attention-no-scale",
        "kvjax/model/prefill_attention.py",
        '"bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))',
        '"bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32)',
        ("tests/kvjax/test_causal_attention.py", "tests/kvjax/test_parity.py"),
        "the dense prefill attention loses 1/sqrt(D)",
    ),
    M(
        "mlp-gelu-not-silu",
        "kvjax/model/decoder.py",
        'return jax.nn.gelu(gate, approximate=True) if cfg.hidden_act == "gelu_tanh" else jax.nn.silu(gate)',
        'return jax.nn.gelu(gate, approximate=True) if cfg.hidden_act == "gelu_tanh" else jax.nn.gelu(gate)',
        ("tests/kvjax/test_parity.py",),
        "the MLP's gate activation is GELU instead of SiLU",
    ),
    M(
        "engine-prefill-positions-shifted",
        "kvjax/engine/core.py",
        "positions = jnp.broadcast_to(jnp.arange(t), (b, t))",
        "positions = jnp.broadcast_to(jnp.arange(t) + 1, (b, t))",
        ("tests/kvjax/test_engine.py",),
        "the prompt's RoPE positions start at 1 while decode continues from the prompt length",
    ),
    # ---- the budget arithmetic (kvjax/budget.py) ---------------------------------------------------------------
    M(
        "budget-ceil-rounded-down",
        "kvjax/budget.py",
        "return (n // q) * p + ((n % q) * p + q - 1) // q",
        "return (n // q) * p + ((n % q) * p) // q",
        ("tests/kvjax/test_budget_contract.py",),
        "a fractional budget keeps floor(b n) tokens instead of ceil(b n)",
        k=K_BUDGET,
    ),
    M(
        "budget-floor-rounded-up",
        "kvjax/budget.py",
        "return (n // q) * p + ((n % q) * p) // q",
        "return (n // q) * p + ((n % q) * p + q - 1) // q",
        ("tests/kvjax/test_budget_contract.py",),
        "floor_mul rounds up (Chelsea's budget, PQCache's split, merge counts overshoot)",
        k=K_BUDGET,
    ),
    M(
        "budget-fraction-rounded-up",
        "kvjax/budget.py",
        "f = Fraction(math.floor(f * MAX_DENOMINATOR), MAX_DENOMINATOR)",
        "f = Fraction(math.ceil(f * MAX_DENOMINATOR), MAX_DENOMINATOR)",
        ("tests/kvjax/test_budget_contract.py",),
        "a fraction with more than four decimals is rounded up to the 1/10000 grid (budget above the ceiling)",
        k=K_BUDGET,
    ),
    # ---- baselines: H2O, StreamingLLM, SnapKV, PyramidKV ------------------------------------------------------
    M(
        "h2o-unaccumulated",
        "kvjax/methods/h2o.py",
        "new = jax.lax.dynamic_slice_in_dim(score, start, c, axis=2) + jnp.where(take, w, 0.0)",
        "new = 0 * jax.lax.dynamic_slice_in_dim(score, start, c, axis=2) + jnp.where(take, w, 0.0)",
        ("tests/kvjax/test_h2o_step.py",),
        "H2O's decode score is the last step's weight, not the accumulated sum",
    ),
    M(
        "h2o-gqa-sum",
        "kvjax/methods/h2o.py",
        "/ den[..., None]).mean(axis=2)",
        "/ den[..., None]).sum(axis=2)",
        ("tests/kvjax/test_h2o_step.py",),
        "H2O's decode weights summed over the group's query heads, not averaged (prompt scores stay means)",
    ),
    M(
        "h2o-evicts-heaviest",
        "kvjax/methods/h2o.py",
        "take & (p < threshold[:, None, None]), jax.lax.dynamic_slice_in_dim(score, start, c, axis=2), jnp.inf",
        "take & (p < threshold[:, None, None]), -jax.lax.dynamic_slice_in_dim(score, start, c, axis=2), jnp.inf",
        ("tests/kvjax/test_h2o_step.py",),
        "H2O evicts the heaviest hitter instead of the lightest",
    ),
    M(
        "h2o-recent-off-by-one",
        "kvjax/methods/h2o.py",
        "threshold = pos - self.recent_tokens(state.limit) + 1",
        "threshold = pos - self.recent_tokens(state.limit)",
        ("tests/kvjax/test_h2o_step.py",),
        "H2O's protected recent window is one token shorter",
    ),
    M(
        "streaming-one-sink-fewer",
        "kvjax/methods/streaming.py",
        "return jnp.minimum(self.sinks, jnp.maximum(s - 1, 0)) if",
        "return jnp.minimum(self.sinks - 1, jnp.maximum(s - 1, 0)) if",
        T_BASE,
        "StreamingLLM keeps one attention sink fewer (and one more recent token)",
        k="streaming",
    ),
    M(
        "streaming-ring-off-by-one",
        "kvjax/methods/streaming.py",
        "slot = jnp.where(pos < sk, pos, sk + jnp.mod(pos - sk, jnp.maximum(s - sk, 1)))",
        "slot = jnp.where(pos < sk, pos, sk + jnp.mod(pos - sk + 1, jnp.maximum(s - sk, 1)))",
        T_BASE,
        "a decode token overwrites the second-oldest recent token instead of the oldest",
        k="streaming",
    ),
    M(
        "snapkv-gqa-max",
        "kvjax/methods/core/select.py",
        "p = jnp.where(mask[:, None, None], p, 0.0)\n    return p.sum(axis=3).mean(axis=2)",
        "p = jnp.where(mask[:, None, None], p, 0.0)\n    return p.sum(axis=3).max(axis=2)",
        T_BASE,
        "SnapKV's votes aggregated over a group's query heads by max instead of mean",
        k="snapkv",
    ),
    M(
        "snapkv-gqa-sum",
        "kvjax/methods/core/select.py",
        "p = jnp.where(mask[:, None, None], p, 0.0)\n    return p.sum(axis=3).mean(axis=2)",
        "p = jnp.where(mask[:, None, None], p, 0.0)\n    return p.sum(axis=3).sum(axis=2)",
        T_BASE,
        "SnapKV's votes summed over a group's query heads instead of averaged",
        k="snapkv",
        equivalent="a sum over the G query heads is G times their mean: every vote scales alike, so the top-k "
        "(after average or max pooling, both linear in a common factor) selects the same tokens",
    ),
    M(
        "snapkv-window-off-by-one",
        "kvjax/methods/core/select.py",
        "qpos = lengths[:, None] - window + jnp.arange(window)",
        "qpos = lengths[:, None] - window - 1 + jnp.arange(window)",
        T_BASE,
        "SnapKV's observation window is shifted one query back",
        k="snapkv",
    ),
    M(
        "snapkv-window-one-short",
        "kvjax/methods/core/select.py",
        "return jnp.minimum(window, budgets).astype(jnp.int32)",
        "return jnp.minimum(window - 1, budgets).astype(jnp.int32)",
        T_BASE,
        "the kept recent window is one token shorter than the observation window",
        k="snapkv",
    ),
    M(
        "topk-keeps-worst",
        "kvjax/methods/core/select.py",
        "masked = jnp.where(cand, scores, NEG_INF)",
        "masked = jnp.where(cand, -scores, NEG_INF)",
        T_BASE,
        "the selection keeps the lowest-scored prefix tokens",
        k="snapkv",
    ),
    M(
        "snapkv-pool-leaks-window",
        "kvjax/methods/core/scorers.py",
        "s = jnp.where(jnp.arange(votes.shape[-1]) < prefix_end[:, None, None], votes, 0.0)",
        "s = jnp.where(jnp.arange(votes.shape[-1]) < prefix_end[:, None, None] + 2, votes, 0.0)",
        T_BASE,
        "pooling lets the observation window's own votes leak into the last prefix tokens",
        k="snapkv",
    ),
    M(
        "pyramid-layer-off-by-one",
        "kvjax/methods/snapkv.py",
        "pyramid = hi2 - layer * step + window",
        "pyramid = hi2 - (layer + 1) * step + window",
        T_BASE,
        "PyramidKV's per-layer budget taken from the next layer down",
        k="pyramid",
    ),
    # ---- ChunkKV -----------------------------------------------------------------------------------------------
    M(
        "chunkkv-chunk-score-max",
        "kvjax/methods/chunkkv.py",
        "chunk_scores = s.reshape(b, h, nc, c).sum(-1)",
        "chunk_scores = s.reshape(b, h, nc, c).max(-1)",
        ("tests/kvjax/test_chunkkv.py",),
        "a chunk is scored by its best token instead of the sum over its tokens",
    ),
    M(
        "chunkkv-chunks-rounded-up",
        "kvjax/methods/chunkkv.py",
        "kchunks = (budgets - windows) // c",
        "kchunks = -(-(budgets - windows) // c)",
        ("tests/kvjax/test_chunkkv.py",),
        "ChunkKV keeps ceil((P - w) / c) chunks (over the budget) instead of floor",
    ),
    M(
        "chunkkv-reuse-ignored",
        "kvjax/methods/chunkkv.py",
        "return self.reuse == 1 or layer % self.reuse == 0",
        "return True or layer % self.reuse == 0",
        ("tests/kvjax/test_chunkkv.py",),
        "layer-wise index reuse silently off: every layer selects its own chunks (Alg. 2 not followed)",
    ),
    # ---- Quest -------------------------------------------------------------------------------------------------
    M(
        "quest-kmin-kmax-swapped",
        "kvjax/methods/quest.py",
        'return jnp.einsum("bhd,bhpd->bhp", qp, sl(state.kmax), precision=hi) + jnp.einsum(\n'
        '                "bhd,bhpd->bhp", qn, sl(state.kmin), precision=hi',
        'return jnp.einsum("bhd,bhpd->bhp", qp, sl(state.kmin), precision=hi) + jnp.einsum(\n'
        '                "bhd,bhpd->bhp", qn, sl(state.kmax), precision=hi',
        ("tests/kvjax/test_quest.py",),
        "Quest's upper bound pairs q+ with the page minimum and q- with the maximum",
    ),
    M(
        "quest-page-max-not-updated",
        "kvjax/methods/quest.py",
        "kmax = jnp.where(opens, kn, jnp.maximum(page(state.kmax), kn))",
        "kmax = jnp.where(opens, kn, page(state.kmax))",
        ("tests/kvjax/test_quest.py",),
        "a decoded token is not folded into its page's key maximum",
    ),
    M(
        "quest-bound-of-mean-query",
        "kvjax/methods/quest.py",
        "qp, qn = jnp.mean(jnp.maximum(qg, 0.0), axis=2), jnp.mean(jnp.minimum(qg, 0.0), axis=2)",
        "qp, qn = jnp.maximum(jnp.mean(qg, axis=2), 0.0), jnp.minimum(jnp.mean(qg, axis=2), 0.0)",
        ("tests/kvjax/test_quest.py",),
        "GQA: the bound of the group's mean query instead of the mean of the query heads' bounds",
    ),
    M(
        "quest-current-page-dropped",
        "kvjax/methods/quest.py",
        "return jnp.concatenate([jnp.where(ok, idx, -1).astype(jnp.int32), current], axis=-1)",
        "return jnp.concatenate([jnp.where(ok, idx, -1).astype(jnp.int32), current * 0 - 1], axis=-1)",
        ("tests/kvjax/test_quest.py",),
        "Quest does not attend the current (incomplete) page, the new token's own",
    ),
    # ---- PQCache -----------------------------------------------------------------------------------------------
    M(
        "pq-lookup-mean",
        "kernels_pallas/pq_lookup/reference.py",
        "out = jnp.take_along_axis(lut, idx, axis=-1).sum(axis=3)",
        "out = jnp.take_along_axis(lut, idx, axis=-1).mean(axis=3)",
        ("tests/kernels_pallas/test_pq_lookup.py",),
        "the PQ score is the mean over sub-spaces instead of the sum (q·k_hat scaled by 1/m)",
    ),
    M(
        "pq-window-overlaps-candidates",
        "kvjax/methods/pqcache/__init__.py",
        "end = jnp.minimum(jnp.asarray(t, jnp.int32) - w, state.filled)",
        "end = jnp.minimum(jnp.asarray(t, jnp.int32) - w + 1, state.filled)",
        ("tests/kvjax/test_pqcache.py",),
        "PQCache's retrieval candidates reach one token into the local window",
        k="match_reference",
    ),
    M(
        "pq-group-softmax-unnormalised",
        "kvjax/methods/pqcache/retrieval.py",
        "agg = sum_small_axis(p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30), 2)",
        "agg = sum_small_axis(p, 2)",
        ("tests/kvjax/test_pqcache.py",),
        "GQA: the group's per-head softmax weights are summed unnormalised",
        k="reference",
    ),
    M(
        "pq-kmeans-includes-sinks",
        "kvjax/methods/pqcache/index.py",
        "valid = (pos[None, :] >= sink) & (pos[None, :] < lengths[:, None])",
        "valid = (pos[None, :] >= 0) & (pos[None, :] < lengths[:, None])",
        ("tests/kvjax/test_pqcache.py",),
        "the prompt's K-means (codebooks and codes) also takes the sink tokens",
        k="reference",
    ),
    # ---- ClusterKV and the cosine K-means references -----------------------------------------------------------
    M(
        "clusterkv-group-max",
        "kvjax/methods/clusterkv/recall.py",
        "qg = qg.mean(axis=2, keepdims=True)",
        "qg = qg.max(axis=2, keepdims=True)",
        ("tests/kvjax/test_clusterkv.py",),
        "GQA group_mean: clusters ranked by the element-wise max of the group's queries instead of their mean",
    ),
    M(
        "clusterkv-window-clustered-late",
        "kvjax/methods/clusterkv/__init__.py",
        "full = jnp.all(t + 1 - state.clustered >= self.window)",
        "full = jnp.all(t + 1 - state.clustered > self.window)",
        ("tests/kvjax/test_clusterkv.py",),
        "decode clusters its window of new tokens one step late",
    ),
    M(
        "cosine-assign-dot-product",
        "kernels_pallas/cosine_kmeans/reference.py",
        "        normalise_centroids(centroids),\n        precision=HIGHEST,",
        "        centroids.astype(jnp.float32),\n        precision=HIGHEST,",
        ("tests/kernels_pallas/test_cosine_kmeans.py",),
        "K-means assigns by dot product with the raw centroids instead of cosine similarity",
    ),
    M(
        "kmeans-empty-cluster-zeroed",
        "kernels_pallas/cosine_kmeans/reference.py",
        "return jnp.where(counts[..., None] > 0, mean, centroids.astype(jnp.float32))",
        "return mean",
        ("tests/kernels_pallas/test_cosine_kmeans.py", "tests/kvjax/test_clusterkv.py"),
        "an empty cluster's centroid becomes zero instead of staying where it was",
    ),
    # ---- LESS --------------------------------------------------------------------------------------------------
    M(
        "less-lse-without-state",
        "kvjax/methods/less/parallel.py",
        "lse = jnp.logaddexp(lse_sp, log_lr)",
        "lse = lse_sp + 0 * log_lr",
        ("tests/kvjax/test_less.py",),
        "LESS's normaliser leaves out the low-rank state's phi(q)·z (Eq. 3's denominator)",
    ),
    M(
        "less-state-order-flipped",
        "kvjax/methods/less/__init__.py",
        "if self.evicts_before_attending:",
        "if not self.evicts_before_attending:",
        ("tests/kvjax/test_less.py",),
        "LESS folds the evicted pair into H, z after attending where its policy evicts before, and vice versa",
    ),
    M(
        "less-z-not-updated",
        "kvjax/methods/less/__init__.py",
        "H, z = state.H + dH, state.z + pe",
        "H, z = state.H + dH, state.z",
        ("tests/kvjax/test_less.py",),
        "an evicted token is folded into H but not into z (Eq. 5)",
    ),
    # ---- a decode budget (kvjax/methods/core/bounded.py) -------------------------------------------------------
    M(
        "bounded-every-off-by-one",
        "kvjax/methods/core/bounded.py",
        "need = (jnp.mod(steps, self.every) == 0) & (cache.length > floor)",
        "need = (jnp.mod(steps + 1, self.every) == 0) & (cache.length > floor)",
        T_BOUNDED,
        "a decode budget re-compresses one step before every `every`-th step",
        k=K_BOUNDED,
    ),
    M(
        "bounded-ring-slot-off-by-one",
        "kvjax/methods/core/bounded.py",
        "r = jnp.mod(pos, w)",
        "r = jnp.mod(pos + 1, w)",
        T_BOUNDED,
        "the ring of recent queries writes each query over the slot of the next one (the newest query lost)",
        k=K_BOUNDED,
    ),
    M(
        "bounded-threshold-unnormalised",
        "kvjax/methods/core/bounded.py",
        "passing = jnp.sum(before & (scores >= threshold * queries[:, None, None]), axis=-1)",
        "passing = jnp.sum(before & (scores >= threshold), axis=-1)",
        T_BOUNDED,
        "the threshold compares the summed window votes, not their mean over the ring's queries",
        k=K_BOUNDED,
    ),
    M(
        "bounded-threshold-window-counted",
        "kvjax/methods/core/bounded.py",
        "before = jnp.arange(s) < (count - w)[..., None]",
        "before = jnp.arange(s) < count[..., None]",
        T_BOUNDED,
        "the threshold counts the kept window's tokens among those passing (the budget grows by them)",
        k=K_BOUNDED,
    ),
    # ---- GGUF SentencePiece tokenizers (kvjax/loading/tokenizer.py) --------------------------------------------------
    M(
        "spm-gemma-no-space-normalizer",
        "kvjax/loading/tokenizer.py",
        r'backend.normalizer = normalizers.Replace(" ", "\u2581")',
        "pass",
        ("tests/kvjax/test_tokenizer.py",),
        "a Gemma SentencePiece vocabulary looks spaces up as spaces instead of U+2581",
        k="sentencepiece",
    ),
    M(
        "spm-merges-worst-first",
        "kvjax/loading/tokenizer.py",
        "merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)",
        "merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))",
        ("tests/kvjax/test_tokenizer.py",),
        "the merges a SentencePiece vocabulary implies are applied lowest score first",
        k="sentencepiece",
    ),
    # ---- per-layer plans (kvjax/methods/plans/layers.py) -------------------------------------------------------
    M(
        "fullfirst-one-full-layer-short",
        "kvjax/methods/plans/layers.py",
        'return full_below(self.n_full, static_layer(layer, "FullFirst.at"), self.inner.at(layer))',
        'return full_below(self.n_full - 1, static_layer(layer, "FullFirst.at"), self.inner.at(layer))',
        ("tests/kvjax/test_layers.py",),
        "full_layers=N runs full on N - 1 layers",
        k="by_hand or not_a_method",
    ),
    M(
        "own-full-layers-one-short",
        "kvjax/methods/plans/layers.py",
        "return full_below(self.n_full, layer, self)",
        "return full_below(self.n_full - 1, layer, self)",
        ("tests/kvjax/test_layers.py",),
        "ClusterKV's and Quest's n_full gives one layer fewer to full",
        k="own_full_layers",
    ),
    # ---- evaluation (eval/, benchmarks/) -------------------------------------------------------------------------
    M(
        "runner-resume-recomputes",
        "eval/runner.py",
        "        return self.done.get(self.key(meta, batch))",
        "        return None",
        ("tests/eval/test_harness.py",),
        "a resumed kvjax-eval run computes every cell again instead of reading back the ones its folder holds",
        k="resumes_and_grows",
    ),
    M(
        "kvpress-in-context-position-off-by-one",
        "benchmarks/kvpress_ruler.py",
        "position_ids=torch.tensor([[length + i]])",
        "position_ids=torch.tensor([[length + i + 1]])",
        ("tests/benchmarks/test_kvpress_ruler.py",),
        "the torch side of the papers' protocol decodes each answer token one position late",
        k="greedy",
    ),
)

#: ``--subset ci``: a fixed handful of fast mutants across a method, a kernel reference, the budget and the model
#: (each killed within seconds of its test file's start), so the check itself cannot rot.
CI = (
    "chelsea-no-log-bias",
    "decode-ref-length-mask-ignored",
    "budget-ceil-rounded-down",
    "h2o-recent-off-by-one",
    "rope-decode-position-off-by-one",
    "quest-kmin-kmax-swapped",
)


def copy_tree(dst: Path) -> None:
    """The repository's files (tracked + untracked, not ignored) into ``dst``."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / os.fsdecode(f)
        if not src.is_file():  # deleted in the work tree, or a submodule
            continue
        out = dst / os.fsdecode(f)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)


def line_of(text: str, snippet: str) -> int:
    return text[: text.index(snippet)].count("\n") + 1


def check(mutant: Mutant, root: Path) -> tuple[str, int]:
    """The file's text and the snippet's line; raises when the snippet does not occur exactly once."""
    path = root / mutant.file
    text = path.read_text()
    n = text.count(mutant.original)
    if n != 1:
        raise SystemExit(
            f"mutant {mutant.id}: the original snippet occurs {n} times in {mutant.file} (must be once); "
            f"the code moved: update the mutant in scripts/mutations.py\n--- snippet:\n{mutant.original}"
        )
    if mutant.original == mutant.replacement:
        raise SystemExit(f"mutant {mutant.id}: replacement equals the original")
    for t in mutant.tests:
        if not t.startswith("-") and not (root / t.split("::")[0]).is_file():
            raise SystemExit(f"mutant {mutant.id}: its test file {t} does not exist")
    return text, line_of(text, mutant.original)


def env_for(root: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a restored file of the same size and second must not hit a stale .pyc
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def pytest_cmd(mutant: Mutant) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", "--no-header"]
    if mutant.k:
        cmd += ["-k", mutant.k]
    return cmd + list(mutant.tests)


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def run_one(mutant: Mutant, root: Path, timeout: float) -> dict:
    text, line = check(mutant, root)
    path = root / mutant.file
    path.write_text(text.replace(mutant.original, mutant.replacement))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            pytest_cmd(mutant), cwd=root, env=env_for(root), capture_output=True, text=True, timeout=timeout
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    finally:
        path.write_text(text)
    secs = time.monotonic() - t0
    if rc is None:
        status = "timeout"
    elif rc == 0:
        status = "survived"
    elif rc == 1:
        status = "killed"
    else:  # 2 interrupted / collection error, 4 usage, 5 no tests: the mutant broke the run, not a test
        status = f"error (pytest exit {rc})"
    m = _FAILED.search(out)
    summary = [ln for ln in out.strip().splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return {
        "id": mutant.id,
        "file": mutant.file,
        "line": line,
        "status": status,
        "killed_by": m.group(1) if m else None,
        "seconds": round(secs, 1),
        "tests": " ".join(mutant.tests) + (f" -k '{mutant.k}'" if mutant.k else ""),
        "description": mutant.description,
        "equivalent": mutant.equivalent,
        "pytest_summary": summary[-1] if summary else out.strip().splitlines()[-1:] or "",
        "tail": None if status in ("killed", "survived") else out[-3000:],
    }


def ok(r: dict) -> bool:
    return (r["status"] == "survived") if r["equivalent"] else r["status"] in ("killed", "timeout")


def markdown(results: list[dict], meta: dict) -> str:
    killed = sum(r["status"] == "killed" for r in results)
    eq = [r for r in results if r["equivalent"]]
    bad = [r for r in results if not ok(r)]
    lines = [
        "# Mutation check",
        "",
        f"`python3 scripts/mutations.py{meta['args']}` at commit {meta['commit']} on {meta['date']} "
        f"({meta['host']}, {meta['cpus']} CPUs; jax {meta['jax']}): {len(results)} mutants, {killed} killed, "
        f"{len(eq)} equivalent (expected to survive), {len(bad)} not as expected; {meta['seconds']:.0f} s in all.",
        "",
        "Each mutant is applied alone to a copy of the repository and its test files run with "
        "`python3 -m pytest -x`; *killed by* is the first failing test. `scripts/mutations.py` holds each "
        "mutant's exact original and replacement.",
        "",
        "| mutant | file:line | status | killed by | s | what it breaks |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        status = r["status"] + (" (equivalent)" if r["equivalent"] else "")
        by = f"`{r['killed_by']}`" if r["killed_by"] else ""
        lines.append(
            f"| {r['id']} | {r['file']}:{r['line']} | {status} | {by} | {r['seconds']:.0f} | {r['description']} |"
        )
    if eq:
        lines += ["", "Equivalent mutants (they change no output):", ""]
        lines += [f"- **{r['id']}**: {r['equivalent']}." for r in eq]
    if bad:
        lines += ["", "Not as expected:", ""]
        lines += [f"- **{r['id']}**: {r['status']} ({r['pytest_summary']})" for r in bad]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--subset", choices=["ci", "all"], default="all", help="ci: a fixed handful of fast mutants")
    ap.add_argument("--out", help="write the report as JSON here and as markdown beside it (.md)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mutant (a timeout counts as killed)")
    ap.add_argument(
        "--tests",
        help="space-separated pytest arguments run for every chosen mutant instead of its own tests (which "
        "mutants does this one test kill?)",
    )
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument(
        "--check", action="store_true", help="only check every snippet occurs once and every test file exists"
    )
    args = ap.parse_args(argv)

    ids = [m.id for m in MUTANTS]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise SystemExit(f"duplicate mutant ids: {sorted(dup)}")
    chosen = list(MUTANTS)
    if args.subset == "ci":
        chosen = [m for m in MUTANTS if m.id in CI]
    if args.only:
        want = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(want) - set(ids))
        if unknown:
            raise SystemExit(f"unknown mutant ids: {unknown}; see --list")
        chosen = [m for m in chosen if m.id in want]
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(args.tests.split()), k=None) for m in chosen]
    if args.list:
        for m in chosen:
            eq = " [equivalent]" if m.equivalent else ""
            print(f"{m.id:34s} {m.file:48s} {m.description}{eq}")
        return 0
    for m in chosen:
        check(m, ROOT)
    if args.check:
        print(f"{len(chosen)} mutants: every original snippet occurs exactly once, every test file exists")
        return 0

    import jax  # noqa: PLC0415  (for the report only)

    t_all = time.monotonic()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = commit.stdout.strip() + ("+uncommitted" if dirty else "")  # what the copy holds
    results = []
    with tempfile.TemporaryDirectory(prefix="kvjax-mutations-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        probe = subprocess.run(
            [sys.executable, "-c", "import kvjax, kernels_pallas; print(kvjax.__file__, kernels_pallas.__file__)"],
            cwd=root,
            env=env_for(root),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if not all(Path(p).resolve().is_relative_to(root.resolve()) for p in probe.split()):
            raise SystemExit(f"the copy does not import its own packages: {probe}")
        for i, m in enumerate(chosen):
            r = run_one(m, root, args.timeout)
            results.append(r)
            mark = "ok " if ok(r) else "!! "
            print(
                f"{mark}[{i + 1}/{len(chosen)}] {m.id}: {r['status']} in {r['seconds']:.0f} s "
                f"{r['killed_by'] or r['pytest_summary']}",
                flush=True,
            )
    shown = []  # the command line without --out and its value
    given = list(argv if argv is not None else sys.argv[1:])
    for i, a in enumerate(given):
        if not (a.startswith("--out") or (i and given[i - 1] == "--out")):
            shown.append(a)
    meta = {
        "args": "".join(f" {a}" for a in shown),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "seconds": time.monotonic() - t_all,
    }
    bad = [r for r in results if not ok(r)]
    print(
        f"{len(results)} mutants: {sum(r['status'] == 'killed' for r in results)} killed, "
        f"{sum(bool(r['equivalent']) for r in results)} equivalent, {len(bad)} not as expected "
        f"({', '.join(r['id'] for r in bad) or 'none'}); {meta['seconds']:.0f} s"
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**meta, "mutants": results}, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(results, meta))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
