"""Resident memory of an eval sweep, run as a script in a fresh process (``tests/eval/test_memory.py``).

``python3 tests/eval/memory_sweep.py sweep [--keep]``: ``kvjax-eval``'s runner over 20 configurations (full and
three compressing methods at three budgets, on two prompt-length tasks) on a tiny random model.
``python3 tests/eval/memory_sweep.py single METHOD BUDGET LENGTH``: one of those configurations alone;
``largest``: the last method at the largest budget and prompt alone (what the test compares the sweep with).
``--keep`` stubs out the runner's release (what the runner did before it released finished configurations).
Prints one JSON line: ``peak_mib`` (``ru_maxrss``), ``end_mib`` (RSS at the end, /proc/self/statm), ``configs``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from eval import runner  # noqa: E402
from kvjax import engine, methods  # noqa: E402
from kvjax.config import ModelConfig  # noqa: E402
from kvjax.loading import Model  # noqa: E402
from kvjax.methods.base import Capacity  # noqa: E402
from kvjax.model import random_params  # noqa: E402

METHODS = methods.cover("budget", "has_decode_partial", "recalls")  # full, streaming_llm, snapkv, pqcache
BUDGETS = (0.2, 0.4, 0.6)
LENGTHS = (96, 400)  # one task per prompt length: buckets 128 and 512
NEW = 4


@dataclasses.dataclass(frozen=True)
class PromptTask:
    """Two random prompts of ``length`` tokens (and ``length - 7``), ``NEW`` greedy tokens each."""

    length: int
    name: str = "prompts"

    def prepare(self, model):
        rng = np.random.default_rng(self.length)
        ids = [[int(t) for t in rng.integers(1, model.config.vocab_size, n)] for n in (self.length, self.length - 7)]
        return engine.bucket_length(self.length), [ids]

    def capacity(self, prepared) -> Capacity:
        return Capacity(prepared[0], NEW)

    def run_batch(self, model, method, prepared, batch, meta) -> list[dict]:
        out = engine.generate(model, batch, method, NEW, driver="python", prompt_len=prepared[0])
        return [{**meta, "tokens": t} for t in out.tokens]


def rss_mib() -> float:
    """Resident memory of this process now (Linux: /proc/self/statm's resident pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tiny_model() -> Model:
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_windows=(None, None),
    )
    return Model(cfg, random_params(cfg, jax.random.PRNGKey(1), scale=0.3), None, "tiny")


def main(argv):
    model = tiny_model()
    if argv[0] == "single":
        names, budgets, lengths = [argv[1]], [float(argv[2])], [int(argv[3])]
    elif argv[0] == "largest":
        names, budgets, lengths = [METHODS[-1]], [max(BUDGETS)], [max(LENGTHS)]
    else:
        names, budgets, lengths = list(METHODS), list(BUDGETS), list(LENGTHS)
        if "--keep" in argv:
            runner.release_compiled = lambda: None
    tasks = [dataclasses.replace(PromptTask(n), name=f"prompts{n}") for n in lengths]
    results = runner.run(model, tasks, names, budgets, progress=False)
    print(
        json.dumps(
            {
                "configs": len(results["timings"]["runs"]),
                "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "end_mib": rss_mib(),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
