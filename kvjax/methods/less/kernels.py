"""The LESS kernels and their file format (``less``, :mod:`kvjax.methods.less`; Dong et al., 2024, §3.2).

Kernels φ (per query head) and ψ (per KV head) are :class:`LessKernels`: the method note's §2.3/§8.2 "code"
form — φ(q) = |gelu(gelu(q W1) W2)|, ψ(k) = |u + (u W3) ⊙ s2| with u = |s1| ⊙ gelu(gelu(k W1) W2), exact
(erf) GELU, no biases, dropout on the first pre-activation (training only), scales ``s1, s2 [Hkv, R]``
initialised at 1e-4 (the paper's warm start, §3.2). Rank ``R`` (default 8), hidden width (default 512).

A trained set is a folder of ``kernels.npz`` (every layer's parameters, ``[L, ...]``) and ``less_config.json``
(format, model identity, kernel, policy and training config, per-layer losses); :func:`load_kernels` reads and
checks it against the model, :func:`parse_layers` / :func:`format_layers` name the layer subsets a training run
covers.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

KERNELS_FILE = "kernels.npz"


CONFIG_FILE = "less_config.json"


FORMAT = "kvjax-less-kernels/1"


#: Fields of the model config that a kernel file must match (the head layout and the model's identity).
MODEL_KEYS = ("model_type", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")


def gelu(x):
    """Exact (erf) GELU, as torch's ``F.gelu`` (the note's A5: not the tanh approximation)."""
    return jax.nn.gelu(x, approximate=False)


def _per_head(x, w):
    """``x [B, H, ..., Din] @ w [H, Din, Dout]`` per head -> ``[B, H, ..., Dout]`` (float32)."""
    b, h = x.shape[:2]
    flat = x.reshape(b, h, -1, x.shape[-1]).astype(jnp.float32)
    out = jnp.einsum("bhnd,hde->bhne", flat, w.astype(jnp.float32))
    return out.reshape(*x.shape[:-1], w.shape[-1])


def _per_head_vec(s, x):
    """Broadcast a per-head vector ``s [H, R]`` over ``x [B, H, ..., R]``."""
    return s.reshape((1, s.shape[0]) + (1,) * (x.ndim - 3) + (s.shape[1],))


class LessKernels(nn.Module):
    """φ and ψ of one attention layer (paper Eqs. 1-2 in the released code's form; method note §2.3, §8.2).

    Params: ``q_w1 [Hq, D, Rh]``, ``q_w2 [Hq, Rh, R]``, ``k_w1 [Hkv, D, Rh]``, ``k_w2 [Hkv, Rh, R]``,
    ``k_w3 [Hkv, R, R]``, ``k_s1, k_s2 [Hkv, R]`` (init ``scale_init``). Weights: Glorot-uniform per head.
    """

    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    rank: int = 8
    hidden: int = 512
    dropout: float = 0.3
    scale_init: float = 1e-4

    def setup(self):
        glorot = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform", in_axis=-2, out_axis=-1, batch_axis=(0,))
        d, rh, r, hq, hk = self.head_dim, self.hidden, self.rank, self.n_q_heads, self.n_kv_heads
        self.q_w1 = self.param("q_w1", glorot, (hq, d, rh))
        self.q_w2 = self.param("q_w2", glorot, (hq, rh, r))
        self.k_w1 = self.param("k_w1", glorot, (hk, d, rh))
        self.k_w2 = self.param("k_w2", glorot, (hk, rh, r))
        self.k_w3 = self.param("k_w3", glorot, (hk, r, r))
        self.k_s1 = self.param("k_s1", nn.initializers.constant(self.scale_init), (hk, r))
        self.k_s2 = self.param("k_s2", nn.initializers.constant(self.scale_init), (hk, r))
        self.drop = nn.Dropout(self.dropout)

    def phi(self, q, deterministic: bool = True):
        """Query features ``[B, Hq, ..., R]`` (>= 0) of post-RoPE ``q [B, Hq, ..., D]``."""
        h = gelu(self.drop(_per_head(q, self.q_w1), deterministic=deterministic))
        return jnp.abs(gelu(_per_head(h, self.q_w2)))

    def psi(self, k, deterministic: bool = True):
        """Key features ``[B, Hkv, ..., R]`` (>= 0) of post-RoPE ``k [B, Hkv, ..., D]``."""
        h = gelu(self.drop(_per_head(k, self.k_w1), deterministic=deterministic))
        u = _per_head_vec(jnp.abs(self.k_s1), k) * gelu(_per_head(h, self.k_w2))
        u = u + _per_head(u, self.k_w3) * _per_head_vec(self.k_s2, k)
        return jnp.abs(u)

    def __call__(self, q, k, deterministic: bool = True):
        return self.phi(q, deterministic), self.psi(k, deterministic)


def module_for(kernels) -> LessKernels:
    """The :class:`LessKernels` module matching one layer's params (shapes read from them)."""
    hq, d, rh = kernels["q_w1"].shape
    return LessKernels(
        n_q_heads=hq, n_kv_heads=kernels["k_w1"].shape[0], head_dim=d, rank=kernels["q_w2"].shape[-1], hidden=rh
    )


def init_kernels(model_cfg, key, rank: int = 8, hidden: int = 512) -> dict:
    """Fresh params (``{"q_w1": ..., ...}``, float32) of one layer's kernels for ``model_cfg``."""
    return _init_kernels(model_cfg, key, rank, hidden)


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _init_kernels(model_cfg, key, rank, hidden):
    mod = LessKernels(model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim, rank, hidden)
    d = model_cfg.head_dim
    q = jnp.zeros((1, model_cfg.num_heads, 1, d))
    k = jnp.zeros((1, model_cfg.num_kv_heads, 1, d))
    return dict(mod.init(key, q, k)["params"])


def mlp_phi(kernels, q):
    """Default φ hook: the MLP, deterministic. ``q [B, Hq, ..., D]`` -> ``[B, Hq, ..., R]``."""
    return module_for(kernels).apply({"params": kernels}, q, method="phi")


def mlp_psi(kernels, k):
    """Default ψ hook: the MLP, deterministic. ``k [B, Hkv, ..., D]`` -> ``[B, Hkv, ..., R]``."""
    return module_for(kernels).apply({"params": kernels}, k, method="psi")


@functools.lru_cache(maxsize=4)
def _load_kernels(path: str, mtime: float):
    folder = Path(path)
    meta = json.loads((folder / CONFIG_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"kernels={path!r}: {CONFIG_FILE} has format {meta.get('format')!r}, expected {FORMAT!r}; "
            "train kernels with kvjax-train-less"
        )
    with np.load(folder / KERNELS_FILE) as f:
        arrays = {name: np.asarray(f[name]) for name in f.files}
    return meta, arrays


def load_kernels(path, model_cfg=None):
    """``(meta, {name: [L, ...] np.ndarray})`` from a ``kvjax-train-less`` output folder. With ``model_cfg``,
    refuses kernels trained for another model or head layout (ValueError naming each mismatch)."""
    folder = Path(path)
    for f in (CONFIG_FILE, KERNELS_FILE):
        if not (folder / f).is_file():
            raise FileNotFoundError(
                f"kernels={str(path)!r} has no {f}; pass the output folder of kvjax-train-less "
                "(it holds kernels.npz and less_config.json)"
            )
    meta, arrays = _load_kernels(str(folder.resolve()), (folder / KERNELS_FILE).stat().st_mtime)
    if model_cfg is not None:
        check_model(meta, model_cfg, f"kernels={str(path)!r}")
    return meta, arrays


def parse_layers(spec, num_layers: int) -> list[int]:
    """Layer indices from ``"0-7"``, ``"0,2,5-9"``, an int or a list (``None``: all), checked against the model."""
    if spec is None:
        return list(range(num_layers))
    given = spec
    if isinstance(spec, int):
        spec = [spec]
    if isinstance(spec, str):
        out = []
        try:
            for part in spec.split(","):
                a, _, b = part.strip().partition("-")
                out.extend(range(int(a), int(b if b else a) + 1))
        except ValueError:
            raise ValueError(f"layers={spec!r}: expected layer indices such as '0-7' or '0,2,5-9'") from None
        spec = out
    out = sorted(set(int(x) for x in spec))
    if not out or out[0] < 0 or out[-1] >= num_layers:
        raise ValueError(
            f"layers={given!r}: the model has layers 0-{num_layers - 1}; pass a non-empty subset such as '0-7'"
        )
    return out


def format_layers(layers) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, layers = [], sorted(layers)
    for i, x in enumerate(layers):
        if i and x == layers[i - 1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def model_identity(model_cfg, name: str | None = None) -> dict:
    """What a kernel file records about its model (and must match to be reused)."""
    ident = {key: getattr(model_cfg, key) for key in MODEL_KEYS}
    ident["name"] = name
    return ident


def check_model(meta: dict, model_cfg, what: str):
    want = meta.get("model", {})
    bad = [
        f"{key}: trained for {want.get(key)!r}, this model has {getattr(model_cfg, key)!r}"
        for key in MODEL_KEYS
        if want.get(key) != getattr(model_cfg, key)
    ]
    if bad:
        raise ValueError(
            f"{what} were trained for another model ({want.get('name')!r}) or head layout: "
            f"{'; '.join(bad)}. Train kernels for this model with kvjax-train-less"
        )
