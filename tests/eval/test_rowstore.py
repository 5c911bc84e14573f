"""eval.rowstore: a folder's settings grow in the grid settings only, records survive a line cut by a kill."""

import json

import pytest

from eval import rowstore


def test_settings_grow_in_the_grid_and_nowhere_else():
    held = {"model": "m", "methods": ["full", "h2o"], "options": {"h2o": {"window": 8}}}
    wanted = {"model": "m", "methods": ["snapkv", "full"], "options": {"snapkv": {"window": 4}}, "protocols": ["b"]}
    got = rowstore.merge_settings(held, wanted, ("methods", "options", "protocols"), defaults={"protocols": ["a"]})
    assert got == {
        "model": "m",
        "methods": ["full", "h2o", "snapkv"],
        "options": {"h2o": {"window": 8}, "snapkv": {"window": 4}},
        "protocols": ["a", "b"],
    }
    with pytest.raises(ValueError, match=r"model: 'm' there, 'n' here.*--restart"):
        rowstore.merge_settings(held, {**wanted, "model": "n"}, ("methods", "options"))
    with pytest.raises(ValueError, match=r"options.h2o differs"):
        rowstore.merge_settings(held, {**wanted, "options": {"h2o": {"window": 9}}}, ("methods", "options"))


def test_new_options_for_a_member_the_folder_ran_are_a_clash():
    """``owners``: a method (or a NIAH config's method) the folder ran without options ran with its defaults."""
    held = {"configs": [["h2o", 128]], "options": {}}
    grid, owners = ("configs", "options"), {"options": "configs"}
    with pytest.raises(ValueError, match=r"options.h2o differs \(its defaults there, \{'recent': 2\} here\)"):
        rowstore.merge_settings(held, {"configs": [], "options": {"h2o": {"recent": 2}}}, grid, owners=owners)
    got = rowstore.merge_settings(
        held, {"configs": [["snapkv", 96]], "options": {"snapkv": {"window": 4}}}, grid, owners=owners
    )
    assert got["options"] == {"snapkv": {"window": 4}}  # a method new to the folder takes its options
    assert rowstore.merge_settings(held, {"configs": [], "options": {"h2o": {"recent": 2}}}, grid)  # without owners


def test_a_cut_line_is_dropped_and_the_header_grows(tmp_path):
    store = rowstore.RowStore(tmp_path, {"model": "m", "methods": ["a"]}, ("methods",))
    store.append({"config": "a", "rows": [1]})
    store.append({"config": "a2", "rows": [2]})
    text = (tmp_path / rowstore.ROWS).read_text()
    (tmp_path / rowstore.ROWS).write_text(text[: len(text) - 9])  # the last record cut short by a kill
    again = rowstore.RowStore(tmp_path, {"model": "m", "methods": ["b"]}, ("methods",))
    assert again.records == [{"config": "a", "rows": [1]}] and again.settings["methods"] == ["a", "b"]
    lines = (tmp_path / rowstore.ROWS).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"settings": {"model": "m", "methods": ["a", "b"]}}, again.records[0]]
    assert rowstore.read_settings(tmp_path) == again.settings
    with pytest.raises(FileNotFoundError, match="holds no needle run"):
        rowstore.read_settings(tmp_path / "none", "needle run")
    assert rowstore.RowStore(tmp_path, {"model": "n"}, restart=True).records == []
