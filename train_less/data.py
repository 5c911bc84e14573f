"""Training text for LESS kernels: text files, folders and jsonl; by default the embedded essays and Bible.

Each source (a file, a folder's files, or the embedded essays / Bible) is tokenized into one stream of ids
(documents joined by the tokenizer's EOS id) and cut into non-overlapping windows of ``seq_len`` tokens;
windows are taken round-robin across sources so a small sample still mixes them. Held out of the default
corpus, for evaluation: the last ``HELDOUT_ESSAYS`` essays (sorted by name) and the Gospel of ``HELDOUT_BOOK``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from kvjax.loading import assets

HELDOUT_ESSAYS = 8
HELDOUT_BOOK = "John"
TEXT_SUFFIXES = (".txt", ".md", ".jsonl", ".json")


def _jsonl_texts(path: Path) -> list[str]:
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if isinstance(rec, str):
                out.append(rec)
            elif isinstance(rec, dict) and isinstance(rec.get("text"), str):
                out.append(rec["text"])
            else:
                raise ValueError(f"{path}:{n}: a jsonl record must be a string or an object with a 'text' field")
    return out


def read_source(path: str | Path) -> list[str]:
    """Documents of one source: a text file (one document), a jsonl file (a 'text' per line) or a folder
    (its text/jsonl files, sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise FileNotFoundError(f"data folder {path} has no {'/'.join(TEXT_SUFFIXES)} files")
        return [doc for f in files for doc in read_source(f)]
    if not path.is_file():
        raise FileNotFoundError(f"data={str(path)!r} does not exist; pass text files, jsonl files or folders")
    if path.suffix == ".jsonl":
        return _jsonl_texts(path)
    return [path.read_text(encoding="utf-8")]


def default_sources() -> dict[str, list[str]]:
    """The embedded corpus minus the held-out parts: {"essays": [...], "bible": [...]}."""
    names = assets.essay_names()[:-HELDOUT_ESSAYS]
    books: dict[str, list[str]] = {}
    with assets.bible_path().open(encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if v["book"] != HELDOUT_BOOK:
                books.setdefault(v["book"], []).append(v["text"])
    return {"essays": [assets.essay(n) for n in names], "bible": [" ".join(vs) for vs in books.values()]}


def heldout_sources() -> dict[str, list[str]]:
    """The held-out embedded text: {"essays": last essays, "bible": the Gospel of John}."""
    names = assets.essay_names()[-HELDOUT_ESSAYS:]
    return {"essays": [assets.essay(n) for n in names], "bible": [assets.bible_text(HELDOUT_BOOK)]}


def hf_source(name: str, split: str = "train", field: str = "text", limit: int = 2000) -> list[str]:
    """Documents of a Hugging Face dataset (e.g. ``allenai/c4``), streamed; needs ``datasets`` and the hub."""
    try:
        import datasets  # noqa: PLC0415
    except ImportError as e:
        raise ValueError(
            f"hf_dataset={name!r} needs the 'datasets' package (pip install datasets); or pass "
            "--data with local text/jsonl files"
        ) from e
    try:
        ds = datasets.load_dataset(name, split=split, streaming=True)
        return [rec[field] for _, rec in zip(range(limit), ds)]
    except Exception as e:  # network, unknown name, missing field
        raise ValueError(
            f"could not read hf_dataset={name!r} split={split!r} field={field!r} "
            f"({type(e).__name__}: {e}); pass --data with local files where the hub is unreachable"
        ) from e


def windows(tokenizer, docs: Iterable[str], seq_len: int, limit: int | None = None) -> np.ndarray:
    """``[n, seq_len]`` int32 non-overlapping windows of the token stream of ``docs`` (EOS between docs)."""
    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc))
        if eos is not None:
            ids.append(eos)
        if limit is not None and len(ids) >= limit * seq_len:
            break
    n = len(ids) // seq_len if limit is None else min(limit, len(ids) // seq_len)
    return np.asarray(ids[: n * seq_len], np.int32).reshape(n, seq_len)


def sequences(tokenizer, sources: dict[str, list[str]], seq_len: int, num: int) -> np.ndarray:
    """Up to ``num`` windows of ``seq_len`` tokens, round-robin across ``sources`` -> ``[N, seq_len]``."""
    if seq_len < 2 or num < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 2 and num={num} >= 1")
    per = [windows(tokenizer, docs, seq_len, limit=num) for docs in sources.values()]
    out = []
    for i in range(max((len(w) for w in per), default=0)):
        out.extend(w[i] for w in per if i < len(w))
    if not out:
        raise ValueError(f"the corpus has fewer than seq_len={seq_len} tokens; add text or shorten --seq-len")
    return np.stack(out[:num])
