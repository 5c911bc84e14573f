"""The model and its attention math, as pure functions over a params pytree.

- :mod:`kvjax.model.decoder`: the decoder (Llama family, Qwen3, Gemma 3, gpt-oss): ``embed``, ``layer_qkv``,
  ``layer_finish``, ``run_layers``, ``forward``, ...; its public names are re-exported here
  (``from kvjax.model import forward``);
- :mod:`kvjax.model.attention`: decode attention returning partials (routes to ``kernels_pallas.decode_attention``);
- :mod:`kvjax.model.prefill_attention`: causal prefill attention (chunked pure-JAX reference, cuDNN, splash);
- :mod:`kvjax.model.rope`: rotary embeddings; :mod:`kvjax.model.sinks`: learned attention sinks (gpt-oss).

The model's description (:class:`kvjax.config.ModelConfig`) and the device mesh (:mod:`kvjax.sharding`) sit
beside this package, not in it: the methods and the loaders use them too.
"""

from kvjax.model.decoder import (
    ATTENTION_CHUNK,
    TOKEN_BLOCK,
    Params,
    causal_attention,
    embed,
    forward,
    is_stacked,
    layer_finish,
    layer_finish_blocks,
    layer_params,
    layer_qkv,
    layer_qkv_blocks,
    layer_step,
    logits,
    mlp,
    moe_mlp,
    random_params,
    rms_norm,
    run_layers,
    scan_layers,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "ATTENTION_CHUNK",
    "TOKEN_BLOCK",
    "Params",
    "causal_attention",
    "embed",
    "forward",
    "is_stacked",
    "layer_finish",
    "layer_finish_blocks",
    "layer_params",
    "layer_qkv",
    "layer_qkv_blocks",
    "layer_step",
    "logits",
    "mlp",
    "moe_mlp",
    "random_params",
    "rms_norm",
    "run_layers",
    "scan_layers",
    "stack_layers",
    "unstack_layers",
]
