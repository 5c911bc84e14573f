"""``kvjax.load_model``: a Hugging Face folder, a hub id, a GGUF file, or the embedded default.

>>> model = kvjax.load_model("smollm2-135m-instruct")          # embedded SmolLM2-135M-Instruct (GGUF Q4_1)
>>> model = kvjax.load_model("gemma3-270m")                    # embedded Gemma 3 270M, hybrid layers (GGUF Q4_K_M)
>>> model = kvjax.load_model("/path/to/Llama-3.2-1B-Instruct")  # local HF folder (sharded safetensors ok)
>>> model = kvjax.load_model("Qwen/Qwen2.5-0.5B-Instruct")     # hub id (downloads where the hub is reachable)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from kvjax.loading import assets
from kvjax.loading.checkpoint import check_shapes, load_safetensors_params
from kvjax.config import ModelConfig
from kvjax.loading.gguf_loader import config_from_gguf, load_gguf_params, open_gguf
from kvjax.model import Params

if TYPE_CHECKING:
    from kvjax.loading.tokenizer import Tokenizer

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: static config, params pytree, tokenizer, and where it came from."""

    config: ModelConfig
    params: Params
    tokenizer: "Tokenizer | None"
    name: str
    load_seconds: float = 0.0
    #: The ``jax.sharding.Mesh`` the params are split over (:mod:`kvjax.sharding`), or None (one device).
    mesh: Any = None

    @property
    def dtype(self):
        return self.params["embed"].dtype

    @property
    def num_parameters(self) -> int:
        """Elements of every parameter array (tied embeddings counted once)."""
        return int(sum(x.size for x in jax.tree.leaves(self.params)))

    def __repr__(self) -> str:
        """One line: name, family, layers, heads, sizes, dtype and parameter count, not the weights
        (``model.params`` holds them)."""
        c = self.config
        n = self.num_parameters
        count = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"
        mesh = "" if self.mesh is None else f", mesh={dict(self.mesh.shape)}"
        return (
            f"Model({self.name!r}, {c.model_type}, layers={c.num_layers}, heads={c.num_heads}, "
            f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, hidden={c.hidden_size}, vocab={c.vocab_size}, "
            f"dtype={jnp.dtype(self.dtype).name}, params={count}{mesh})"
        )


def default_dtype():
    """bfloat16 on accelerators; float32 on CPU (where bf16 matmuls are slow and tests want fp32)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _resolve(name_or_path: str | Path) -> tuple[str, Path]:
    """-> ("gguf" | "hf", local path)."""
    embedded = {assets.SMOLLM2_NAME: assets.smollm2_gguf_path, assets.GEMMA3_270M_NAME: assets.gemma3_270m_gguf_path}
    if str(name_or_path) in embedded:
        return "gguf", embedded[str(name_or_path)]()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"name_or_path={str(name_or_path)!r} is a file but not a .gguf; pass the folder of "
                "a Hugging Face checkpoint or a GGUF file"
            )
        return "gguf", path
    if path.is_dir():
        return "hf", path
    text = str(name_or_path)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return "hf", _download(text)
    raise FileNotFoundError(
        f"name_or_path={text!r} is neither an embedded model ({assets.SMOLLM2_NAME!r}, "
        f"{assets.GEMMA3_270M_NAME!r}), an existing folder or .gguf file, nor a hub id of the form 'org/name'"
    )


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # network errors, gated repos, unknown ids: one clear message, with the cause
        raise FileNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); download it "
            "where the hub is reachable and pass the local folder"
        ) from e


def load_model(
    name_or_path: str | Path, dtype=None, tokenizer: bool = True, mesh=None, scan_layers: bool = False
) -> Model:
    """Load a Llama-family model into kvjax.

    name_or_path: ``"smollm2-135m-instruct"`` (embedded default), ``"gemma3-270m"`` (the second embedded model,
    Gemma 3's local/global layers), a local HF folder, a ``.gguf`` file or a hub id. dtype: parameter dtype
    (default: :func:`default_dtype`). tokenizer: also load the tokenizer.
    mesh: a ``jax.sharding.Mesh`` from :func:`kvjax.sharding.make_mesh` or a spec such as ``"data=2,model=4"``:
    the params are placed tensor-parallel on it and everything that runs the model runs sharded
    (:mod:`kvjax.sharding`). The mesh is checked against the model before any weight is read.
    scan_layers: store the layers stacked (``[L, ...]`` leaves, :func:`kvjax.model.stack_layers`); ``generate``
    then runs the layers of every method whose per-layer states agree as one compiled loop body
    (``lax.fori_loop``), so the decode loop of a deep model compiles one layer instead of ``L``
    (docs/architecture.md#scan-over-layers).
    """
    if mesh is not None:
        from kvjax import sharding

        mesh = mesh if isinstance(mesh, sharding.Mesh) else sharding.make_mesh(mesh)
    dtype = default_dtype() if dtype is None else jnp.dtype(dtype)
    start = time.perf_counter()
    kind, path = _resolve(name_or_path)
    if kind == "gguf":
        reader = open_gguf(path)
        cfg = config_from_gguf(reader)
        _check(mesh, cfg)
        params = load_gguf_params(reader, cfg, dtype)
        if tokenizer:
            from kvjax.loading.tokenizer import GGUFTokenizer

            tok = GGUFTokenizer.from_gguf(reader)
        else:
            tok = None
    else:
        cfg = ModelConfig.from_json_file(path / "config.json")
        _check(mesh, cfg)
        params = load_safetensors_params(path, cfg, dtype)
        check_shapes(cfg, params)
        has_tok = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        if tokenizer and has_tok:
            from kvjax.loading.tokenizer import HFTokenizer

            tok = HFTokenizer(path)
        else:
            tok = None  # token ids only
    if scan_layers:
        from kvjax.model import stack_layers

        params = stack_layers(params)
    if mesh is not None:
        params = sharding.shard_params(cfg, params, mesh)
    jax.block_until_ready(params)
    return Model(cfg, params, tok, str(name_or_path), time.perf_counter() - start, mesh)


def _check(mesh, cfg: ModelConfig) -> None:
    if mesh is not None:
        from kvjax import sharding

        sharding.check_mesh(mesh, cfg)


def info(model: Model) -> dict[str, Any]:
    c = model.config
    n = sum(x.size for x in jax.tree.leaves(model.params))
    return {
        "name": model.name,
        "model_type": c.model_type,
        "layers": c.num_layers,
        "heads": c.num_heads,
        "kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "params": int(n),
        "dtype": str(model.dtype),
    }
