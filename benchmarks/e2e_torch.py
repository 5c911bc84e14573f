"""The transformers side of ``benchmarks/e2e.py``: ``LlamaForCausalLM`` and kvpress's ``SnapKVPress`` on it.

``benchmarks/e2e.py`` starts this file once, in its own process (``--torch-python``), and keeps it for the run: it
reads one request per line on stdin (JSON: ``config``, a kvjax ``ModelConfig`` as a dict; ``prompt_len``, ``batch``,
``new_tokens``, ``labels``, ``seed``) and answers each label with a line ``E2E_ROW {json}``, then ``E2E_DONE``.
torch and JAX never share a process (their CUDA libraries and allocators stay apart; e2e.py's memory note).

The model: a ``LlamaConfig`` with the kvjax model's shapes (llama3 rope scaling included), random weights made on the
device in ``--dtype`` (transformers' own initialisation; nothing downloaded), attention ``flash_attention_2`` where
``flash_attn`` is importable on a GPU, else ``sdpa`` (``attn_implementation`` in every row). Labels:

- ``transformers``: full ``DynamicCache``.
- ``kvpress_snapkv@B``: kvpress's ``SnapKVPress(compression_ratio=1 - B)`` as a context manager around the prompt's
  forward (it compresses every layer's cache then, as kvpress's pipeline does), decode outside it with explicit
  ``position_ids`` (kvpress's ``generate_answer``).

Per row: a warm-up (a 128-token prompt, 4 steps), then one timed generation of ``new_tokens`` tokens, greedy:
TTFT [``ttft_s``] = the prompt's forward (``logits_to_keep=1``) + argmax; TPOT [``tpot_s``] = the median of the
``new_tokens - 1`` decode steps (each timed on its own, ``torch.cuda.synchronize`` after it on a GPU; the mean is
``tpot_mean_s``); ``peak_bytes_in_use`` = ``torch.cuda.max_memory_allocated`` (reset before the timed run; None on
CPU); ``kv_bytes_read_per_step`` = the K/V bytes every layer's cache holds after the last step (what a step reads).

kvpress 0.5.5's ``import kvpress`` imports its pipeline (datasets, pandas, fire, cachetools, accelerate, peft);
where that fails, the SnapKV press's own modules (torch and transformers only) are loaded without the package's
``__init__`` and the row says so (``kvpress_import``). Where kvpress is not installed, the wheel in
``benchmarks/wheels/`` is put on ``sys.path`` (a pure-Python wheel imports as a zip).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

ROW, DONE = "E2E_ROW ", "E2E_DONE"
WHEELS = Path(__file__).resolve().parent / "wheels"
KVPRESS_TRANSFORMERS = ">=4.56,<5.3"  # kvpress 0.5.5's METADATA (Requires-Dist); 5.24 renamed past_key_values


def hf_config(cfg: dict, attn: str):
    """A transformers ``LlamaConfig`` with the shapes of the kvjax ``ModelConfig`` ``cfg`` (as a dict)."""
    import transformers

    rope = cfg["rope"]
    scaling = None
    if rope["rope_type"] == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
    elif rope["rope_type"] != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not built here; use a llama or llama3-rope model")
    return transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_kv_heads"],
        head_dim=cfg["head_dim"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=rope["theta"],
        rope_scaling=scaling,
        max_position_embeddings=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        attn_implementation=attn,
    )


def snapkv_press():
    """``(SnapKVPress, how it was imported)``; raises ImportError with the reason where it cannot be."""
    if importlib.util.find_spec("kvpress") is None:
        wheels = sorted(WHEELS.glob("kvpress-*.whl"))
        if not wheels:
            raise ImportError(f"kvpress is not installed and {WHEELS} has no kvpress wheel")
        sys.path.append(str(wheels[-1]))
    try:
        import kvpress

        return kvpress.SnapKVPress, f"kvpress {_version('kvpress')} (package)"
    except ImportError as e:  # the package's __init__ imports its pipeline's dependencies
        for name in [m for m in sys.modules if m == "kvpress" or m.startswith("kvpress.")]:
            del sys.modules[name]
        pkg = types.ModuleType("kvpress")
        pkg.__path__ = list(importlib.util.find_spec("kvpress").submodule_search_locations)
        sys.modules["kvpress"] = pkg
        from kvpress.presses.snapkv_press import SnapKVPress

        return SnapKVPress, f"kvpress {_version('kvpress')} (presses only: import kvpress failed: {e})"


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "wheel " + ",".join(p.name for p in WHEELS.glob(f"{dist}-*.whl")) if dist == "kvpress" else None


def renamed_kwargs(press):
    """kvpress 0.5.5's hook reads ``past_key_values`` and ``cache_position`` from the attention layer's kwargs
    (transformers < 5.3); newer transformers passes the cache as ``cache`` and may pass no ``cache_position``. This
    wraps the press's ``forward_hook`` to add both where missing: the cache itself, and ``arange(q_len)`` (exact here:
    the press is entered only around the prompt's forward on an empty cache). Returns the list of the names added
    (filled as the hook runs)."""
    import torch

    hook, added = press.forward_hook, []

    def forward_hook(module, args, kwargs, output):
        extra = {}
        if "past_key_values" not in kwargs and "cache" in kwargs:
            extra["past_key_values"] = kwargs["cache"]
        if "cache_position" not in kwargs:
            x = kwargs["hidden_states"]
            extra["cache_position"] = torch.arange(x.shape[1], device=x.device)
        added.extend(extra)
        kwargs = {**kwargs, **extra}
        return hook(module, args, kwargs, output)

    press.forward_hook = forward_hook
    return added


class Side:
    """The torch process's model, built on the first request and rebuilt when the config changes."""

    def __init__(self, dtype: str):
        import torch

        self.torch, self.dtype, self.model, self.key = torch, getattr(torch, dtype), None, None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # CPU runs are smoke tests on a shared host
        fa = self.device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        self.attn = "flash_attention_2" if fa else "sdpa"

    def build(self, cfg: dict):
        torch = self.torch
        if self.key == json.dumps(cfg, sort_keys=True):
            return
        self.model = None
        from transformers import LlamaForCausalLM

        t0, default = time.perf_counter(), torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # weights made in the dtype, on the device (no float32 copy)
        try:
            with torch.device(self.device):
                self.model = LlamaForCausalLM(hf_config(cfg, self.attn)).eval()
        finally:
            torch.set_default_dtype(default)
        self.sync()
        self.build_s, self.key = time.perf_counter() - t0, json.dumps(cfg, sort_keys=True)
        self.weights = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, ids, steps: int, press) -> dict:
        """Prefill ``ids [B, n]`` (under ``press``), then ``steps`` greedy decode steps, each timed."""
        torch, model = self.torch, self.model
        from transformers import DynamicCache

        cache, n = DynamicCache(), ids.shape[1]
        with torch.inference_mode():
            self.sync()
            t0 = time.perf_counter()
            with press(model) if press is not None else contextlib.nullcontext():
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            self.sync()
            ttft, times = time.perf_counter() - t0, []
            for i in range(steps):
                t = time.perf_counter()
                pos = torch.full_like(tok, n + i)
                out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                self.sync()
                times.append(time.perf_counter() - t)
        layers = cache.layers
        kv = sum(x.keys.numel() * x.keys.element_size() + x.values.numel() * x.values.element_size() for x in layers)
        return {"ttft_s": ttft, "step_s": times, "kv_bytes_read_per_step": int(kv), "held": layers[0].keys.shape[2]}

    def row(self, req: dict, label: str) -> dict:
        torch = self.torch
        press, how, added = None, None, []
        if label.startswith("kvpress_snapkv@"):
            cls, how = snapkv_press()
            press = cls(compression_ratio=1 - float(label.split("@")[1]))
            added = renamed_kwargs(press)
        self.build(req["config"])
        b, n, steps = req["batch"], req["prompt_len"], req["new_tokens"] - 1
        gen = torch.Generator().manual_seed(req.get("seed", 0))
        ids = torch.randint(1, req["config"]["vocab_size"], (b, n), generator=gen).to(self.device)
        self.generate(ids[:, : min(n, 128)], min(steps, 4), press)  # warm-up (> SnapKV's 64-token window)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        g = self.generate(ids, steps, press)
        tpot = statistics.median(g["step_s"])
        return {
            "status": "ok",
            "ttft_s": g["ttft_s"],
            "tpot_s": tpot,
            "tpot_mean_s": statistics.fmean(g["step_s"]),
            "decode_s": sum(g["step_s"]),
            "decode_steps": steps,
            "throughput_tok_s": b / tpot,
            "e2e_s": g["ttft_s"] + sum(g["step_s"]),
            "peak_bytes_in_use": torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None,
            "kv_bytes_read_per_step": g["kv_bytes_read_per_step"],
            "cache_bytes": g["kv_bytes_read_per_step"],  # a DynamicCache holds what it reads
            "tokens_held_per_seq": g["held"],
            "weights_bytes": self.weights,
            "model_build_s": self.build_s,
            "kvpress_import": how,
            "kvpress_kwargs_added": sorted(set(added)),
            **self.versions(),
        }

    def versions(self) -> dict:
        import transformers

        dev = torch_device_name(self.torch, self.device)
        return {
            "torch_version": self.torch.__version__,
            "transformers_version": transformers.__version__,
            "kvpress_version": _version("kvpress"),
            "attn_implementation": self.attn,
            "torch_device": dev,
        }


def torch_device_name(torch, device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def answer(side, req: dict, label: str) -> dict:
    """One row: measured, or skipped/failed with the reason (the run goes on)."""
    if isinstance(side, str):
        return {"status": "skipped", "skipped": side}
    try:
        return side.row(req, label)
    except ImportError as e:
        return {"status": "skipped", "skipped": f"{type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001  (out of memory, an API change: recorded, the next row runs)
        why = f"{type(e).__name__}: {str(e)[:500]}"
        if label.startswith("kvpress"):
            here = side.versions()["transformers_version"]
            why += f" (kvpress 0.5.5 requires transformers {KVPRESS_TRANSFORMERS}; here {here})"
        return {"status": "failed", "skipped": why}
    finally:  # the cache's blocks go back to the device: the JAX process beside this one grows into them
        if side.device.type == "cuda":
            side.torch.cuda.empty_cache()


def main(argv=None) -> int:
    dtype = (argv or sys.argv[1:] or ["bfloat16"])[0]
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        side = Side(dtype)
    except ImportError as e:
        side = f"torch/transformers not importable: {type(e).__name__}: {e}"
    for line in sys.stdin:
        req = json.loads(line)
        for label in req["labels"]:
            print(ROW + json.dumps({"label": label, **answer(side, req, label)}), flush=True)
        print(DONE, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
