"""Running a model with a compressed cache: the layer core and the drivers over it.

- :mod:`kvjax.engine.core`: the plan of each layer's method (``LayerPlan``, resolved once per (model, method)),
  the states, the scanned segments, and the traceable prefill and decode step;
- :mod:`kvjax.engine.drivers`: the jitted ``prefill`` / ``decode_step``, ``run_loop``, ``generate``, ``stream``;
- :mod:`kvjax.engine.accounting`: tokens and bytes held, allocated and read per step (the budget contract);
- :mod:`kvjax.engine.prompts`: tokenizing, buckets and padding, capacity checks;
- :mod:`kvjax.engine.inplace`: one layer of stacked states updated in place (the scanned layer body);
- :mod:`kvjax.engine.prefilled`: one prefill, compressed by many methods;
- :mod:`kvjax.engine.questions`: one compressed context, many questions;
- :mod:`kvjax.engine.sampling`: ``Greedy``, ``Sample``; :mod:`kvjax.engine.census`: the loops of a traced program.

The names below are the front users import (``from kvjax import engine``; ``engine.generate(...)``).
"""

from kvjax.engine.accounting import (
    bytes_read_per_step,
    expected_held_bytes,
    held_bytes,
    Measures,
    layer_methods,
    measure,
    memory_bytes,
    slot_bytes,
    tokens_held,
)
from kvjax.engine.core import (
    TRACE_COUNTS,
    LayerPlan,
    Stacked,
    as_run,
    init_states,
    layer_states,
    plan,
    scan_runs,
)
from kvjax.engine.drivers import (
    DecodeCarry,
    DecodeLoop,
    Result,
    compress_prefilled,
    decode_step,
    describe_plan,
    generate,
    make_result,
    prefill,
    release_compiled,
    run_loop,
    stream,
)
from kvjax.engine.prompts import (
    MIN_BUCKET,
    ChatTemplateWarning,
    bucket_length,
    check_capacity,
    check_method,
    eos_ids,
    pad_prompts,
    prepare_prompts,
    until_eos,
    warn_without_chat,
)
from kvjax.engine.sampling import Greedy, Sample
from kvjax.methods.base import Capacity

__all__ = [
    "MIN_BUCKET",
    "Measures",
    "TRACE_COUNTS",
    "Capacity",
    "ChatTemplateWarning",
    "DecodeCarry",
    "DecodeLoop",
    "Greedy",
    "LayerPlan",
    "Result",
    "Sample",
    "Stacked",
    "as_run",
    "bucket_length",
    "bytes_read_per_step",
    "check_capacity",
    "check_method",
    "compress_prefilled",
    "decode_step",
    "describe_plan",
    "eos_ids",
    "expected_held_bytes",
    "generate",
    "held_bytes",
    "init_states",
    "layer_methods",
    "layer_states",
    "make_result",
    "measure",
    "memory_bytes",
    "pad_prompts",
    "plan",
    "prefill",
    "prepare_prompts",
    "release_compiled",
    "run_loop",
    "scan_runs",
    "slot_bytes",
    "stream",
    "tokens_held",
    "until_eos",
    "warn_without_chat",
]
