"""The decode-attention kernels' tuning knobs, in one table (``TABLE``), and the candidates a sweep measures.

``benchmarks/decode_attention.py --sweep`` times every candidate of ``CANDIDATES[impl]`` on the device at the
shapes given (the target's: 32k slots, batch 8, Llama-3.1-8B's 8 KV heads x 4 x 128, bf16, keep 1 / 0.5 / 0.25 /
0.1 of the blocks), prints the fastest per shape and the candidate with the lowest total time, and writes them
to its JSON; the chosen values are then copied here with the file they come from in ``measured``.

Knobs:
- ``block_size``: slots per block when the caller chooses none (methods with their own block, Quest's pages or
  ClusterKV's, pass theirs). It changes tile sizes only: which slots take part and the bytes read
  (``block_plan_bytes``: a partial last block counts its real rows) do not depend on it.
- pallas_gpu only: Triton's ``num_warps`` and ``num_stages``, and ``target_programs``, the number of programs the
  flash-decoding split aims for (``pallas_gpu.num_splits``: splits per ``(b, h)`` so that ``B * Hkv * splits``
  reaches it; about two waves of an H100's 132 SMs).
"""

from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(frozen=True)
class Tuning:
    block_size: int = 128
    num_warps: int | None = None
    num_stages: int | None = None
    target_programs: int | None = None
    measured: str = ""


#: The values the kernels use. ``measured``: where they come from.
TABLE = {
    "pallas_gpu": Tuning(
        block_size=128,
        num_warps=4,
        num_stages=2,
        target_programs=264,
        measured="not measured on a GPU yet: Triton's defaults for a [16, 128] x [128, 128] tile "
        "and two waves of 132 SMs",
    ),
    "pallas_tpu": Tuning(block_size=128, measured="not measured on a TPU yet: one (8, 128) tile row per step"),
    "xla": Tuning(block_size=128, measured="the reference reads every slot; block_size only shapes block lists"),
}

#: What ``benchmarks/decode_attention.py --sweep`` tries.
CANDIDATES = {
    "pallas_gpu": [
        Tuning(bs, w, st, tp) for bs, w, st, tp in itertools.product((64, 128, 256), (4, 8), (1, 2, 3), (132, 264, 528))
    ],
    "pallas_tpu": [Tuning(bs) for bs in (128, 256, 512, 1024)],
    "xla": [Tuning(128)],
}


def get(impl: str) -> Tuning:
    """The table's row for ``impl`` (``"xla" | "pallas_tpu" | "pallas_gpu"``)."""
    if impl not in TABLE:
        raise ValueError(f"impl={impl!r} has no tuning row; one of {tuple(TABLE)}")
    return TABLE[impl]
