"""kvjax.loading.checkpoint's safetensors reader (``_mapped``: the file mapped, each tensor a numpy view) against the
``safetensors`` package's own PyTorch reader, for every dtype it maps, and its error for a dtype it does not."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from kvjax.loading.checkpoint import _mapped  # noqa: E402


def test_mapped_matches_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).to(torch.float16),
        "f32": torch.randn(2, 3, 4, generator=g),
        "f64": torch.randn(2, generator=g).double(),
        "i64": torch.arange(-3, 6),
        "i32": torch.arange(4, dtype=torch.int32),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    want = load_file(str(path))
    got = _mapped(path)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        ref = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
        assert got[name].shape == ref.shape, name
        np.testing.assert_array_equal(np.asarray(got[name], ref.dtype), ref, err_msg=name)
    assert str(got["bf16"].dtype) == "bfloat16"


def test_unknown_dtype_is_named(tmp_path):
    path = tmp_path / "f8.safetensors"
    save_file({"w": torch.zeros(4).to(torch.float8_e4m3fn)}, str(path))
    with pytest.raises(ValueError, match="'w' has dtype F8_E4M3"):
        _mapped(path)
