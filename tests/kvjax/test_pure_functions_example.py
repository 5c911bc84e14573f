"""The worked example of docs/pure-functions.md runs as printed, and its decode outputs are plain softmax
attention (numpy) over the prompt's real tokens and the new ones, GQA group by group."""

import re
from pathlib import Path

import numpy as np

DOC = Path(__file__).resolve().parents[2] / "docs" / "pure-functions.md"


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/pure-functions.md should hold one python example"
    return blocks[0]


def softmax_attention(q, k, v):
    """``q [Hq, D]`` over ``k, v [Hkv, N, D]``: ``[Hq, D]``, query head ``h`` on KV head ``h // (Hq / Hkv)``."""
    group = q.shape[0] // k.shape[0]
    out = np.empty(q.shape, np.float64)
    for h in range(q.shape[0]):
        kk, vv = k[h // group].astype(np.float64), v[h // group].astype(np.float64)
        s = kk @ q[h].astype(np.float64) / np.sqrt(q.shape[-1])
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vv
    return out


def test_the_pure_functions_example_is_softmax_attention(capsys):
    ns = {"__name__": "pure_functions_example"}
    exec(compile(example(), "docs/pure-functions.md", "exec"), ns)  # noqa: S102
    assert capsys.readouterr().out.strip(), "the example prints its measures"
    k, v, lengths, steps = ns["k"], ns["v"], np.asarray(ns["lengths"]), ns["steps"]
    assert ns["method"].name == "full"
    for i in range(steps):
        for b, n in enumerate(lengths):
            keys = np.concatenate([k[b, :, :n], ns["new_k"][: i + 1, b].transpose(1, 0, 2)], axis=1)
            vals = np.concatenate([v[b, :, :n], ns["new_v"][: i + 1, b].transpose(1, 0, 2)], axis=1)
            want = softmax_attention(ns["new_q"][i, b], keys, vals)
            np.testing.assert_allclose(np.asarray(ns["outs"][i][b]), want, rtol=1e-4, atol=1e-5)
