"""ByteTextLoader: real stdlib corpus, shapes, data-parallel split, exact resume, epochs, errors."""

from __future__ import annotations

import pytest
import torch

from components.models.llama.data import ByteTextLoader, load_corpus

SEQ = 32


def _take(loader: ByteTextLoader, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def _assert_batches_equal(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def _cat_ranks(loaders: list[ByteTextLoader]) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch from every rank's loader, rows concatenated in rank order."""
    batches = [next(loader) for loader in loaders]
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def _dp_loaders(seq_len: int, local: int, dp: int, seed: int = 0) -> list[ByteTextLoader]:
    return [ByteTextLoader(seq_len, local, r, dp, seed) for r in range(dp)]


def test_corpus_is_real_stdlib_text_and_deterministic():
    """The corpus is Python source, re-reads identically, and two loaders agree batch by batch."""
    corpus = load_corpus()
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1 and len(corpus) >= 2**20
    raw = corpus.numpy().tobytes()
    assert b"def " in raw and b"import " in raw and b"return" in raw
    assert torch.equal(load_corpus.__wrapped__(), corpus)  # fresh read from disk, not the cache

    a, b = ByteTextLoader(SEQ, 4, 0, 1, seed=7), ByteTextLoader(SEQ, 4, 0, 1, seed=7)
    _assert_batches_equal(_take(a, 5), _take(b, 5))
    other = ByteTextLoader(SEQ, 4, 0, 1, seed=8)
    assert not torch.equal(next(other)[0], next(ByteTextLoader(SEQ, 4, 0, 1, seed=7))[0])


def test_shapes_shift_and_rows_are_corpus_windows():
    """Inputs/labels are (local_batch, seq_len) int64, labels are inputs shifted by one byte."""
    loader = ByteTextLoader(SEQ, 3, 0, 1, seed=0)
    windows = loader.corpus[: loader.windows * SEQ].view(loader.windows, SEQ).long()
    for _ in range(3):
        x, y = next(loader)
        assert x.shape == y.shape == (3, SEQ)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row, label in zip(x, y):
            (match,) = (windows == row).all(dim=1).nonzero(as_tuple=True)
            # The last label is the byte right after the window in the corpus.
            after = {int(loader.corpus[int(w) * SEQ + SEQ]) for w in match}
            assert int(label[-1]) in after


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_ranks_together_take_what_one_big_rank_takes(dp):
    """Ranks 0..dp-1 of one micro-batch, in rank order, equal one rank with local*dp rows."""
    local = 2
    ranks = _dp_loaders(SEQ, local, dp)
    single = ByteTextLoader(SEQ, local * dp, 0, 1, seed=0)
    for _ in range(3):
        x, y = _cat_ranks(ranks)
        xs, ys = next(single)
        assert torch.equal(x, xs) and torch.equal(y, ys)
    assert {r.sample_index for r in ranks} == {single.sample_index} == {3 * local * dp}


def test_state_dict_resumes_exactly():
    """After load_state_dict a fresh loader continues exactly like an uninterrupted one."""
    loader = ByteTextLoader(SEQ, 2, 1, 2, seed=3)
    _take(loader, 5)
    state = loader.state_dict()
    assert state == {"sample_index": 20, "seed": 3, "seq_len": SEQ}
    expected = _take(loader, 4)
    resumed = ByteTextLoader(SEQ, 2, 1, 2, seed=3)
    resumed.load_state_dict(state)
    _assert_batches_equal(_take(resumed, 4), expected)


def test_resume_at_another_dp_world_size_keeps_the_global_position():
    """Saved at dp=4 x local=1 after 3 steps, loaded at dp=2 x local=2: same next samples."""
    four = _dp_loaders(SEQ, 1, 4)
    for _ in range(3):
        _cat_ranks(four)
    state = four[0].state_dict()
    assert all(r.state_dict() == state for r in four)
    two = _dp_loaders(SEQ, 2, 2)
    for loader in two:
        loader.load_state_dict(state)
    for _ in range(2):
        x4, y4 = _cat_ranks(four)
        x2, y2 = _cat_ranks(two)
        assert torch.equal(x2, x4) and torch.equal(y2, y4)


def _window_ids(loader: ByteTextLoader, n: int) -> list[int]:
    """Which corpus window each of the next `n` single-row batches is."""
    seq = loader.seq_len
    heads = loader.corpus[: loader.windows * seq].view(loader.windows, seq)[:, :64].long()
    assert len({tuple(h.tolist()) for h in heads}) == loader.windows  # heads identify windows
    ids = []
    for _ in range(n):
        x, _ = next(loader)
        (match,) = (heads == x[0, :64]).all(dim=1).nonzero(as_tuple=True)
        (w,) = match.tolist()
        assert torch.equal(x[0], loader.corpus[w * seq : (w + 1) * seq].long())
        ids.append(w)
    return ids


def test_each_epoch_is_a_fresh_permutation_of_every_window():
    """With ~16 windows: each epoch visits every window once, in a new shuffled order."""
    seq_len = (len(load_corpus()) - 1) // 16
    loader = ByteTextLoader(seq_len, 1, 0, 1, seed=0)
    w = loader.windows
    assert 16 <= w <= 17
    epochs = [_window_ids(loader, w) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(w))
    assert epochs[0] != list(range(w))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]

    # Ranks whose micro-batches straddle an epoch boundary still split it like one big rank.
    ranks = _dp_loaders(seq_len, 2, 3)
    single = ByteTextLoader(seq_len, 6, 0, 1, seed=0)
    for _ in range(4):  # 24 samples: crosses from epoch 0 into epoch 1
        x, _ = _cat_ranks(ranks)
        assert torch.equal(x, next(single)[0])


@pytest.mark.parametrize("key", ["seed", "seq_len"])
def test_mismatched_state_raises_naming_the_key_and_changes_nothing(key):
    """A checkpoint from another seed or seq_len is refused and the loader is left as it was."""
    loader, twin = ByteTextLoader(SEQ, 2, 0, 1, seed=1), ByteTextLoader(SEQ, 2, 0, 1, seed=1)
    _take(loader, 3)
    _take(twin, 3)
    bad = {**loader.state_dict(), "sample_index": 1000, key: loader.state_dict()[key] + 1}
    with pytest.raises(ValueError, match=rf"{key} = {bad[key]}"):
        loader.load_state_dict(bad)
    assert loader.state_dict() == twin.state_dict()
    _assert_batches_equal(_take(loader, 2), _take(twin, 2))


def test_seq_len_longer_than_the_corpus_is_refused():
    """A window needs seq_len + 1 bytes: seq_len = len(corpus) is too long, one less fits."""
    n = len(load_corpus())
    for seq_len in (n, n + 1, 10 * n):
        with pytest.raises(ValueError, match=rf"seq_len = {seq_len}"):
            ByteTextLoader(seq_len, 1, 0, 1, seed=0)
    loader = ByteTextLoader(n - 1, 1, 0, 1, seed=0)
    assert loader.windows == 1
    x, y = next(loader)
    assert x.shape == (1, n - 1) and int(y[0, -1]) == int(load_corpus()[-1])
