"""zerogpt/parallel/layout.py: a rank's local tensor as blocks of the unsharded parameter, and the flat runs that
place any element range of it (pure arithmetic, checked against torch slicing)."""
from __future__ import annotations

import pytest
import torch

from zerogpt.parallel.layout import ParamLayout, as_layout, global_runs, local_from_full, overlaps

C = 8
LAYOUTS = {
    "qkv rank 1 of 2": ParamLayout((3 * C, C), 0, ((C // 2, C // 2), (C + C // 2, C // 2), (2 * C + C // 2, C // 2))),
    "qkv bias rank 0 of 2": ParamLayout((3 * C,), 0, ((0, C // 2), (C, C // 2), (2 * C, C // 2))),
    "row-parallel rank 0 of 2": ParamLayout((C, 4 * C), 1, ((0, 2 * C),)),
    "row-parallel rank 1 of 2": ParamLayout((C, 4 * C), 1, ((2 * C, 2 * C),)),
    "3-d, middle dim": ParamLayout((3, 10, 4), 1, ((2, 3), (7, 3))),
    "whole": ParamLayout.whole((C, 3)),
}


def _full(layout: ParamLayout) -> torch.Tensor:
    return torch.arange(torch.Size(layout.global_shape).numel()).view(layout.global_shape)


@pytest.mark.parametrize("name", LAYOUTS)
def test_global_runs_place_every_local_range(name):
    layout = LAYOUTS[name]
    full = _full(layout)
    local = local_from_full(full, layout).flatten()
    assert tuple(local_from_full(full, layout).shape) == layout.local_shape
    n = local.numel()
    for start, end in [(0, n), (1, n - 1), (n // 3, n // 3 + 5), (n - 1, n), (3, 3)]:
        runs = global_runs(layout, start, end)
        assert sum(length for _, _, length in runs) == end - start
        placed = [full.flatten()[g: g + k] for g, _, k in runs]
        assert torch.equal(torch.cat(placed) if placed else local[:0], local[start:end]), (start, end)
        assert all(g1 + k1 != g2 or l1 + k1 != l2 for (g1, l1, k1), (g2, l2, _) in zip(runs, runs[1:])), \
            f"adjacent runs not merged: {runs}"


def test_dim0_split_is_one_run_per_block_and_whole_is_one_run():
    assert len(global_runs(LAYOUTS["qkv rank 1 of 2"], 0, 3 * C // 2 * C)) == 3
    assert global_runs(LAYOUTS["whole"], 2, 9) == [(2, 2, 7)]
    assert len(global_runs(LAYOUTS["row-parallel rank 1 of 2"], 0, C * 2 * C)) == C  # one per row


@pytest.mark.parametrize("saved,wanted", [("row-parallel rank 0 of 2", "whole-row"), ("qkv rank 1 of 2", "whole-qkv"),
                                          ("row-parallel rank 1 of 2", "row-parallel rank 1 of 2")])
def test_overlaps_copy_a_piece_into_another_layout(saved, wanted):
    """A piece saved under one layout (a flat sub-range of that rank's local tensor) fills exactly the
    elements it holds of another layout's range, and nothing else."""
    have_layout = LAYOUTS[saved]
    want_layout = {"whole-row": ParamLayout.whole((C, 4 * C)), "whole-qkv": ParamLayout.whole((3 * C, C))}.get(
        wanted, LAYOUTS.get(wanted))
    full = _full(have_layout)
    have_local = local_from_full(full, have_layout).flatten()
    want_local = local_from_full(full, want_layout).flatten()
    p0, p1 = 5, have_local.numel() - 3  # the piece
    w0, w1 = 2, want_local.numel() - 1  # the range a loading rank needs
    piece = have_local[p0:p1]
    out = torch.full((w1 - w0,), -1)
    have = [(g, loc - p0, k) for g, loc, k in global_runs(have_layout, p0, p1)]
    want = [(g, loc - w0, k) for g, loc, k in global_runs(want_layout, w0, w1)]
    for h, w, k in overlaps(want, have):
        out[w: w + k] = piece[h: h + k]
    held = set(piece.tolist())
    expected = torch.tensor([v if v in held else -1 for v in want_local[w0:w1].tolist()])
    assert torch.equal(out, expected)


def test_as_layout_checks_the_local_shape_and_blocks():
    assert as_layout(None, (4, 5)) == ParamLayout.whole((4, 5))
    with pytest.raises(ValueError, match=r"h.0.attn.c_attn.weight: .* local tensor of shape \[12, 8\].* holds \[24, 8\]"):
        as_layout(LAYOUTS["qkv rank 1 of 2"], (24, 8), "h.0.attn.c_attn.weight")
    with pytest.raises(ValueError, match=r"block \(6, 4\) is outside dim 0 of size 8"):
        ParamLayout((8, 2), 0, ((6, 4),))
    assert ParamLayout.from_json(LAYOUTS["3-d, middle dim"].to_json()) == LAYOUTS["3-d, middle dim"]
