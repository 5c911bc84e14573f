"""eval.perplexity's texts: a King James book or the essays, read as consecutive windows."""

import pytest

import kvjax


@pytest.fixture(scope="module")
def smol():
    return kvjax.load_model("smollm2-135m-instruct")


def test_perplexity_reads_the_essays_as_consecutive_windows(smol):
    """``--book essays``: the sequences are consecutive windows of the essays' own tokens (the tokenizer on the
    assets' text), and a request past their end names the option."""
    from eval import perplexity
    from kvjax.loading import assets

    ids = smol.tokenizer.encode(assets.essays_text())
    seqs = perplexity.build(smol, 3, 100, 28, "essays")
    assert seqs.shape == (3, 128) and seqs.ravel().tolist() == ids[: 3 * 128]
    with pytest.raises(ValueError, match="book='essays' has"):
        perplexity.build(smol, len(ids) // 128 + 1, 100, 28, "essays")
