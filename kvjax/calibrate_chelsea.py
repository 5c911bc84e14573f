"""Offline calibration of Chelsea's outlier heads (paper §5.4, App. B; docs/notes/chelsea.md §2.8, A11).

For every (layer, KV head), run the model on calibration windows, build the CSM edges of the post-RoPE keys
(each A token to its most cosine-similar B token in its chunk, sinks and recent window excluded), prune edges
with cosine below ``threshold`` (0.8 in the paper) and measure the fraction of A tokens left without an edge.
Averaged over windows, the ``ceil(ratio * layers * kv_heads)`` heads with the highest fraction (4% in the
paper; ``keep_layers`` forces whole layers in, like Llama-2's layer 0, counted within the ratio) are the
outlier heads that keep their full cache. The result is a small JSON that ``Chelsea(outlier_heads=PATH)``
loads. The paper calibrates on WikiText-2; any text works here, the embedded Paul Graham essays by default.

    kvjax calibrate-chelsea --model smollm2-135m-instruct --out outliers.json [--text FILE]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.chunked_similarity import chunk_best_match
from kvjax import model as M


def no_edge_fraction(k, lengths, *, n_sink: int, n_recent: int, chunk: int, threshold: float, impl=None):
    """Per head, the fraction of A tokens whose best in-chunk B cosine is below ``threshold`` (App. B).

    k ``[B, H, T, D]`` post-RoPE keys, lengths ``[B]`` -> ``[B, H]`` float32 (A tokens with a B partner in
    the middle ``[n_sink, length - n_recent)`` only; 0 where there are none).
    """
    b, h, t, d = k.shape
    mid = t - n_sink
    p = max(1, -(-mid // chunk))
    km = jnp.pad(k[:, :, n_sink:], ((0, 0), (0, 0), (0, p * chunk - mid), (0, 0)))
    slot = n_sink + jnp.arange(p * chunk)
    valid = jnp.broadcast_to(slot[None, None, :] < (lengths - n_recent)[:, None, None], (b, h, p * chunk))
    best, _ = chunk_best_match(km, valid, chunk, impl=impl)
    has_edge = best > -jnp.inf
    low = has_edge & (best < threshold)
    return (low.sum((-1, -2)) / jnp.maximum(has_edge.sum((-1, -2)), 1)).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Probe:
    """The calibration measure's settings (hashable: a static argument of :func:`_window_fractions`)."""

    n_sink: int
    n_recent: int
    chunk: int
    threshold: float
    impl: str | None = None


@functools.partial(jax.jit, static_argnums=(0, 1))
def _window_fractions(cfg, probe: _Probe, params, tokens):
    """``no_edge_fraction`` of every layer's post-RoPE keys on the full-attention forward of ``tokens [B, T]``:
    ``[L, B, Hkv]``."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    lengths = jnp.full((b,), t, jnp.int32)

    def attend(layer, x, q, k, v, out):
        frac = no_edge_fraction(
            k,
            lengths,
            n_sink=probe.n_sink,
            n_recent=probe.n_recent,
            chunk=probe.chunk,
            threshold=probe.threshold,
            impl=probe.impl,
        )
        return M.causal_attention(q, k, v, lengths, cfg.sliding_windows[layer]), out + (frac,)

    _, out = M.run_layers(cfg, params, M.embed(params, tokens, cfg), positions, attend, ())
    return jnp.stack(out)


def default_text() -> str:
    from kvjax.loading import assets

    return "\n\n".join(p.read_text(errors="replace") for p in sorted(assets.essays_dir().glob("*.txt")))


def _check_args(cfg, window: int, ratio: float, n_sink: int, n_recent: int, chunk: int, keep_layers) -> None:
    """ValueError naming the first :func:`calibrate` argument out of range for ``cfg``."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio={ratio} must be in [0, 1] (the share of KV heads kept full; 0.04 in the paper)")
    if chunk < 2 or chunk % 2:
        raise ValueError(f"chunk={chunk} must be an even integer >= 2")
    if window <= n_sink + n_recent + 2:
        raise ValueError(f"window={window} must exceed n_sink + n_recent + 2 = {n_sink + n_recent + 2}")
    if window > cfg.max_position_embeddings:
        raise ValueError(f"window={window} exceeds the model context {cfg.max_position_embeddings}; lower --window")
    for layer in keep_layers:
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"keep_layers contains {layer}, outside the model's {cfg.num_layers} layers")


def _calibration_ids(model, text_path, token_ids) -> np.ndarray:
    """The calibration tokens: ``token_ids``, else ``text_path`` (default the embedded essays) tokenised."""
    if token_ids is None:
        if model.tokenizer is None:
            raise ValueError("the model has no tokenizer; pass token_ids")
        if text_path is not None and not Path(text_path).is_file():
            raise FileNotFoundError(f"text={text_path!r}: no such file")
        text = Path(text_path).read_text(errors="replace") if text_path is not None else default_text()
        token_ids = model.tokenizer.encode(text, add_special_tokens=False)
    return np.asarray(token_ids, np.int32)


def calibrate(
    model,
    out,
    *,
    text_path=None,
    token_ids=None,
    window: int = 4096,
    windows: int = 32,
    ratio: float = 0.04,
    threshold: float = 0.8,
    n_sink: int = 16,
    n_recent: int = 64,
    chunk: int = 256,
    keep_layers: tuple[int, ...] = (),
    impl: str | None = None,
) -> dict:
    """Find the outlier heads of ``model`` and write them to ``out`` (JSON). Returns the written dict.

    Calibration windows are consecutive, non-overlapping ``window``-token slices of the tokenised text
    (``text_path``; default the embedded essays) or of ``token_ids``; the first ``windows`` of them are used
    (deterministic). Shows progress with tqdm.
    """
    from tqdm.auto import tqdm

    cfg = model.config
    _check_args(cfg, window, ratio, n_sink, n_recent, chunk, keep_layers)
    source = "token_ids" if token_ids is not None else str(text_path) if text_path is not None else "embedded essays"
    ids = _calibration_ids(model, text_path, token_ids)
    count = min(windows, len(ids) // window)
    if count < 1:
        raise ValueError(
            f"the calibration text has {len(ids)} tokens, fewer than one window of {window}; give a "
            "longer text or a smaller --window"
        )
    probe = _Probe(n_sink, n_recent, chunk, float(threshold), impl)
    total = np.zeros((cfg.num_layers, cfg.num_kv_heads), np.float64)
    for i in tqdm(range(count), desc="calibrate-chelsea", unit="window"):
        toks = jnp.asarray(ids[None, i * window : (i + 1) * window])
        total += np.asarray(_window_fractions(cfg, probe, model.params, toks))[:, 0]
    frac = total / count
    n_out = math.ceil(ratio * cfg.num_layers * cfg.num_kv_heads - 1e-9)
    chosen = [(layer, h) for layer in sorted(set(keep_layers)) for h in range(cfg.num_kv_heads)]
    order = sorted(
        ((layer, h) for layer in range(cfg.num_layers) for h in range(cfg.num_kv_heads)), key=lambda lh: (-frac[lh], lh)
    )
    for lh in order:
        if len(chosen) >= n_out:
            break
        if lh not in chosen:
            chosen.append(lh)
    result = {
        "model": getattr(model, "name", ""),
        "num_layers": cfg.num_layers,
        "num_kv_heads": cfg.num_kv_heads,
        "outlier_heads": sorted([list(x) for x in chosen]),
        "no_edge_fraction": [[round(float(x), 6) for x in row] for row in frac],
        "config": {
            "threshold": threshold,
            "ratio": ratio,
            "chunk": chunk,
            "n_sink": n_sink,
            "n_recent": n_recent,
            "window": window,
            "windows": count,
            "keep_layers": sorted(set(keep_layers)),
            "text": source,
        },
        "jax_version": jax.__version__,
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    return result
