"""scripts/fingerprint.py: a refactor's proof that no computation changed. Equal programs hash alike, a changed
one does not, and ``--compare`` lists exactly the configurations that differ (exit 1)."""

import json

from kvjax import methods
from repo_scripts import load_script

fp = load_script("scripts/fingerprint.py", "fingerprint_script")


def test_same_program_same_hash_and_a_change_shows(monkeypatch):
    a = fp.fingerprint("snapkv", 0.2)
    assert a == fp.fingerprint("snapkv", 0.2)
    assert a["decode"] != fp.fingerprint("h2o", 0.2)["decode"]  # H2O's decode also accumulates scores
    snap = type(methods.get("snapkv", budget=0.2))
    real = snap.decode
    monkeypatch.setattr(snap, "decode", lambda self, st, layer, q, k, v, pos: real(self, st, layer, 2 * q, k, v, pos))
    changed = fp.fingerprint("snapkv", 0.2)
    assert changed["prefill"] == a["prefill"] and changed["decode"] != a["decode"]


def test_compare_lists_what_differs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fp.methods, "names", lambda: ["full", "streaming_llm"])
    before = tmp_path / "before.json"
    assert fp.main([str(before)]) == 0
    data = json.loads(before.read_text())
    assert set(data) == {"full@0.2", "full@128", "streaming_llm@0.2", "streaming_llm@128"}
    assert fp.main([str(tmp_path / "same.json"), "--compare", str(before)]) == 0
    data["streaming_llm@128"]["decode"] = "0" * 16
    before.write_text(json.dumps(data))
    assert fp.main([str(tmp_path / "after.json"), "--compare", str(before)]) == 1
    assert "differ: ['streaming_llm@128']" in capsys.readouterr().out
