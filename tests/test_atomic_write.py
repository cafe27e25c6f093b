"""write_text_atomic / write_json_atomic: the target is whole after a write, nothing is left beside it, and a write
that fails part-way leaves the old file as it was."""
import json
import os

import pytest

from zerogpt.atomic_write import write_json_atomic, write_text_atomic


def test_a_write_replaces_the_file_whole_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "sub" / "plan.json"
    write_json_atomic(path, {"b": 1, "a": 2}, sort_keys=True)
    write_json_atomic(path, {"b": 3, "a": 4}, sort_keys=True)
    assert path.read_text() == json.dumps({"a": 4, "b": 3}, indent=1)
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_a_write_stopped_part_way_keeps_the_old_file_and_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "meta.json"
    write_text_atomic(path, "old")

    def disk_full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(path, "new, half written")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]
