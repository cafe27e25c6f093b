"""Checkpoints written by an earlier commit (tests/assets/checkpoints, tests/checkpoint_fixture.py) load today,
resume bit for bit, and save again as the same files."""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.checkpoint_fixture import CASES, EXPECTED, ROOT, resume_rank
from tests.dist_utils import run_distributed


def _same_files(written: str, again: str) -> list[str]:
    """What differs between two checkpoint directories: names, meta.json's content, other files' bytes."""
    names = sorted(os.listdir(written))
    if names != sorted(os.listdir(again)):
        return [f"files {names} vs {sorted(os.listdir(again))}"]
    differ = []
    for name in names:
        with open(os.path.join(written, name), "rb") as a, open(os.path.join(again, name), "rb") as b:
            old, new = a.read(), b.read()
        if name == "meta.json":
            old, new = json.loads(old), json.loads(new)
        if old != new:
            differ.append(name)
    return differ


@pytest.mark.timeout(240)
def test_older_checkpoints_resume_bit_for_bit_and_save_as_the_same_files(tmp_path):
    with open(EXPECTED) as f:
        written = json.load(f)
    expected = written["losses"]
    losses = run_distributed(resume_rank, 2, ROOT, str(tmp_path), timeout=200)
    for case in CASES:
        assert [rank[case] for rank in losses] == expected[case], (
            f"{case}: the resumed losses differ from those {written['written_by'][:7]} recorded (written with torch "
            f"{written['torch']}, running {torch.__version__}: another torch may round differently)")
        assert _same_files(os.path.join(ROOT, case), str(tmp_path / case)) == [], case
