"""Hybrid local/global models by composition: a local (sliding-window) layer holds a ring buffer of its window, the
chosen method compresses the global layers.

Gemma 3 (five local layers of a 512-1024-token window to one global), gpt-oss (alternating 128-token windows and
full layers), Mistral v0.1 and Qwen2/Qwen3 with ``use_sliding_window`` have layers that only ever attend the last
``w`` tokens. Such a layer needs no compression method: :class:`Window` keeps exactly those ``w`` tokens in a ring
(position ``p`` in slot ``p mod w``), so its memory and its reads per step are bounded by the window whatever the
prompt, and its attention is the model's own. :func:`for_model` wraps the chosen method in a :class:`Hybrid` plan
(``Hybrid.at(layer)``: :class:`Window` on a local layer, the method on a global one), which ``generate`` does on
every model with a local layer; the budget contract (``held``), ``memory_bytes``, ``held_bytes`` and
``bytes_read_per_step`` are asked per layer, so they count both kinds. ``compress_local=True`` runs the method on
the local layers too (it then decides what they keep, possibly tokens older than the window, which the model never
attends there: a departure from the model, for studying compression of every layer).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvjax.methods.base import Method, check_budget
from kvjax.methods.plans.layers import PerLayerPlan, check_inner, method_of, static_layer
from kvjax.methods.streaming import StreamingLLM


@dataclasses.dataclass(frozen=True, eq=False)
class Window(StreamingLLM):
    """A local layer's cache: a ring buffer of the last ``budget`` tokens (its sliding window, in tokens; no sinks).
    Holds ``min(n + steps, window)`` tokens; the decode step writes position ``p`` into slot ``p mod window`` and
    attends the window, exactly the sliding-window attention of the model (the prefill attention is the engine's
    sliding-window causal attention)."""

    name: ClassVar[str] = "window"
    budget: int = 4096
    sinks: int = 0

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, int):
            raise ValueError(f"Window(budget={self.budget!r}): the window is a token count (an int >= 1)")
        check_budget(self.budget)
        if self.sinks != 0:
            raise ValueError("Window keeps no sinks (sinks=0); use streaming_llm for sinks plus a window")

    @property
    def window(self) -> int:
        return self.budget


@dataclasses.dataclass(frozen=True, eq=False)
class Hybrid(PerLayerPlan):
    """Per layer: :class:`Window` of ``windows[layer]`` tokens on a local layer (unless ``compress_local``), else
    ``inner.at(layer)`` (``inner``: a method or a plan). ``windows``: the model's ``sliding_windows`` (None: a
    global layer)."""

    windows: tuple
    inner: Method | PerLayerPlan
    compress_local: bool = False

    def __post_init__(self):
        check_inner(self)
        if isinstance(self.inner, Hybrid):
            raise ValueError("Hybrid(inner=Hybrid(...)): the method is already a hybrid plan")
        for layer in range(len(self.windows)):
            if not self.local(layer) and not self.inner.at(layer).starts_at(layer):
                if layer == 0 or self.local(layer - 1):
                    raise ValueError(
                        f"{method_of(self).name}'s layer {layer} reuses the layer before it (index reuse across "
                        f"layers), but layer {layer - 1} is a local sliding-window layer with a ring buffer; use "
                        "reuse=1 on this model"
                    )

    def local(self, layer: int) -> bool:
        """Whether ``layer`` keeps a :class:`Window` ring buffer (a local layer, ``compress_local`` off)."""
        return self.windows[layer] is not None and not self.compress_local

    def at(self, layer: int) -> Method:
        layer = static_layer(layer, "Hybrid.at")
        return Window(int(self.windows[layer])) if self.local(layer) else self.inner.at(layer)

    def describe(self) -> str:
        """E.g. ``"5 local layers: window ring buffers (1024 tokens); 1 global layer: snapkv"``."""
        local = [w for l, w in enumerate(self.windows) if self.local(l)]
        n_global = len(self.windows) - len(local)
        parts = []
        if local:
            sizes = ", ".join(str(w) for w in sorted(set(local)))
            parts.append(f"{len(local)} local layer{'s' * (len(local) != 1)}: window ring buffers ({sizes} tokens)")
        if n_global:
            kind = "" if self.compress_local else "global "
            parts.append(f"{n_global} {kind}layer{'s' * (n_global != 1)}: {method_of(self).name}")
        return "; ".join(parts)


def for_model(model_cfg, method: Method | PerLayerPlan, compress_local: bool = False) -> Method | PerLayerPlan:
    """``method`` as it runs on ``model_cfg``: on a model with a local (sliding-window) layer, the :class:`Hybrid`
    plan (ring buffers on the local layers, ``method`` on the global ones; ``compress_local=True``: ``method`` on
    every layer); else ``method`` itself (a method or a plan). Idempotent: a plan for this model comes back as it
    is (ValueError for a plan built for other windows)."""
    if isinstance(method, Hybrid):
        if method.windows != tuple(model_cfg.sliding_windows):
            raise ValueError(
                f"this Hybrid plan was built for windows {method.windows}, the model has "
                f"{tuple(model_cfg.sliding_windows)}; build it with for_model(model.config, method)"
            )
        return method
    if not model_cfg.is_hybrid:
        return method
    return Hybrid(tuple(model_cfg.sliding_windows), method, compress_local)


def describe(model_cfg, method: Method | PerLayerPlan) -> str:
    """What each kind of layer holds under ``method`` on ``model_cfg`` (``generate``'s ``layer_plan`` stat)."""
    plan = for_model(model_cfg, method)
    if isinstance(plan, Hybrid):
        return plan.describe()
    n = model_cfg.num_layers
    return f"{n} layer{'s' * (n != 1)}: {method_of(method).name}"
