"""Fingerprints of every method's traced programs, to show that a refactor changed no computation.

For each registered method at two budgets (a fraction and a token count), on a small model config, batch 2, a
512-token bucket and two prompt lengths: a hash of the jaxpr of one layer's ``prefill`` and of its ``decode`` (object
addresses removed). Run it at two commits and compare the JSON files; an equal hash is the same computation, so the
tokens kept, the outputs and the compiled program are the same (XLA compiles the same jaxpr alike)::

    git worktree add /tmp/before <commit>
    (cd /tmp/before && PYTHONPATH=/tmp/before python3 /path/to/scripts/fingerprint.py /tmp/before.json)
    PYTHONPATH=. python3 scripts/fingerprint.py /tmp/after.json --compare /tmp/before.json

Only the public interface is used (``methods.get``, ``Method.at/init/prefill/decode``), so the script runs at any
commit that has them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp

from kvjax import methods
from kvjax.config import ModelConfig
from kvjax.methods.base import Capacity

CFG = ModelConfig("llama", 64, 64, 96, 2, 4, 2, 16, max_position_embeddings=4096)
BATCH, BUCKET, LAYER = 2, 512, 1
BUDGETS = (0.2, 128)


def digest(jaxpr) -> str:
    return hashlib.sha1(re.sub(r"0x[0-9a-f]+", "", str(jaxpr)).encode()).hexdigest()[:16]


def fingerprint(name: str, budget) -> dict[str, str]:
    """``{"prefill": hash, "decode": hash}`` of ``name`` at ``budget`` on layer :data:`LAYER`."""
    m = (methods.get(name) if name == "full" else methods.get(name, budget=budget)).at(LAYER)
    state = m.init(CFG, BATCH, Capacity(BUCKET, 8), LAYER, jnp.float32)
    q = jax.random.normal(jax.random.PRNGKey(1), (BATCH, CFG.num_heads, BUCKET, CFG.head_dim))
    k = jax.random.normal(jax.random.PRNGKey(0), (BATCH, CFG.num_kv_heads, BUCKET, CFG.head_dim))
    lengths = jnp.asarray([BUCKET, 300], jnp.int32)

    def prefill(s, q, k, v, n):
        return m.prefill(s, LAYER, q, k, v, n)

    def decode(s, q, k, v, pos):
        return m.decode(s, LAYER, q, k, v, pos)

    filled = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(prefill, state, q, k, k, lengths))
    return {
        "prefill": digest(jax.make_jaxpr(prefill)(state, q, k, k, lengths)),
        "decode": digest(jax.make_jaxpr(decode)(filled, q[:, :, 0], k[:, :, 0], k[:, :, 0], lengths)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="write the fingerprints here (JSON)")
    ap.add_argument("--compare", help="a fingerprint JSON of another commit: list what differs, exit 1 if anything")
    args = ap.parse_args(argv)
    got = {f"{n}@{b}": fingerprint(n, b) for n in methods.names() for b in BUDGETS}
    with open(args.out, "w") as f:
        json.dump(got, f, indent=1)
    if not args.compare:
        return 0
    with open(args.compare) as f:
        other = json.load(f)
    differ = sorted(k for k in got.keys() & other.keys() if got[k] != other[k])
    print(f"{len(got.keys() & other.keys())} configurations in both; differ: {differ or 'none'}")
    only = sorted(got.keys() ^ other.keys())
    if only:
        print(f"in one file only: {only}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
