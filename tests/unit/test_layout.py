import torch

from btnode.model.layout import eval_layout, generation_layout, window_layout


def test_window_layout_segments_and_context_end():
    lay = window_layout(12, 4, phase=1)
    assert lay.segment.tolist() == [-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert lay.context_end.tolist() == [0, 1, 1, 1, 1, 5, 5, 5, 5, 9, 9, 9]
    assert lay.offsets.tolist() == [0, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]


def test_k1_is_the_autoregressive_pattern():
    lay = window_layout(6, 1, 0)
    assert lay.context_end.tolist() == list(range(6)) and lay.segment.tolist() == list(range(6))
    m = lay.mask(6)
    assert torch.equal(m[:, :6], torch.ones(6, 6).tril().bool())
    assert torch.equal(m[:, 6:], torch.eye(6).bool())


def test_eval_layout_scores_the_same_rows_for_every_k_with_half_the_context():
    for k in (1, 4, 16, 64):
        lay = eval_layout(128, k)
        assert lay.positions.tolist() == list(range(64, 128))
        assert int(lay.context_end.min()) == 64


def test_generation_layout_needs_no_mask():
    assert generation_layout(10, 4).mask(10) is None
