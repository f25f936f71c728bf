import pytest
import torch

from accelrun.data import DataError, TensorStream, TokenBatchIterator


def arange_stream(n: int) -> TensorStream:
    # Token i has value i, so a window's first input names its window: start = window * seq_len.
    return TensorStream(
        [torch.arange(n)], vocab_size=n, fingerprint={"source": "test", "sha256": f"arange{n}"}
    )


def make(n=8 * 40 + 1, *, seq_len=8, micro_batch=4, seed=0, shuffle=True, dp_rank=0, dp_size=1):
    return TokenBatchIterator(
        arange_stream(n),
        seq_len=seq_len,
        micro_batch=micro_batch,
        seed=seed,
        shuffle=shuffle,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def windows(batch, seq_len=8) -> list[int]:
    return (batch.inputs[:, 0] // seq_len).tolist()


def take(it, k):
    return [next(it) for _ in range(k)]


def test_packing_inputs_and_targets():
    it = make(shuffle=False)
    b = next(it)
    assert b.inputs.shape == b.targets.shape == (4, 8)
    assert b.inputs.dtype == b.targets.dtype == torch.int64
    assert torch.equal(b.inputs[0], torch.arange(0, 8)) and torch.equal(b.targets[0], torch.arange(1, 9))
    assert torch.equal(b.inputs[1], torch.arange(8, 16))  # stride seq_len: one shared boundary token
    assert it.n_windows == 40 and it.batches_per_epoch == 10


def test_shuffle_is_deterministic_by_seed_and_epoch():
    a = [windows(b) for b in take(make(seed=1), 20)]
    b = [windows(b) for b in take(make(seed=1), 20)]
    c = [windows(b) for b in take(make(seed=2), 20)]
    assert a == b and a != c
    epoch0, epoch1 = sum(a[:10], []), sum(a[10:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))  # every window once per epoch
    assert epoch0 != epoch1 and epoch0 != list(range(40))


def test_epoch_wrap_skips_the_remainder():
    it = make(n=8 * 10 + 1, micro_batch=3, shuffle=False)  # 10 windows, 3 batches of 3 per epoch
    seen = [windows(b) for b in take(it, 3)]
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert (it.epoch, it.position) == (0, 9)
    assert windows(next(it)) == [0, 1, 2] and (it.epoch, it.position) == (1, 3)


@pytest.mark.parametrize("k", [0, 3, 10, 13])
def test_resume_gives_the_same_batches(k):
    it = make(seed=5)
    take(it, k)
    state = it.state_dict()
    expected = take(it, 12)  # crosses an epoch boundary
    resumed = make(seed=5)
    resumed.load_state_dict(state)
    for want, got in zip(expected, take(resumed, 12), strict=True):
        assert torch.equal(want.inputs, got.inputs) and torch.equal(want.targets, got.targets)


def test_resume_adopts_the_saved_seed():
    it = make(seed=5)
    take(it, 2)
    state = it.state_dict()
    other = make(seed=99)
    other.load_state_dict(state)
    assert windows(next(other)) == windows(next(it))


def test_dp_shards_are_disjoint_cover_and_match_one_big_batch():
    ranks = [make(dp_rank=r, dp_size=2, micro_batch=4, seed=3) for r in range(2)]
    single = make(dp_size=1, micro_batch=8, seed=3)
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch == 5
    per_epoch = []
    for _ in range(5):
        w0, w1 = windows(next(ranks[0])), windows(next(ranks[1]))
        assert len(w0) == len(w1) == 4 and not set(w0) & set(w1)
        assert w0 + w1 == windows(next(single))
        per_epoch += w0 + w1
    assert sorted(per_epoch) == list(range(40))
    assert ranks[0].state_dict()["position"] == ranks[1].state_dict()["position"] == 40


def test_reshard_from_two_ranks_to_one():
    ranks = [make(dp_rank=r, dp_size=2, micro_batch=2, seed=7) for r in range(2)]
    for _ in range(3):
        for it in ranks:
            next(it)
    saved = ranks[0].state_dict()
    assert saved["position"] == 12  # global: 3 steps x 2 ranks x 2 windows
    assert {k: v for k, v in ranks[1].state_dict().items() if k != "dp_rank"} == {
        k: v for k, v in saved.items() if k != "dp_rank"
    }
    upcoming = [windows(next(it)) for it in ranks]  # what the two ranks read next

    one = make(dp_size=1, micro_batch=2, seed=7)
    one.load_state_dict(saved)
    assert [windows(next(one)), windows(next(one))] == upcoming
    wide = make(dp_size=1, micro_batch=4, seed=7)
    wide.load_state_dict(saved)
    assert windows(next(wide)) == upcoming[0] + upcoming[1]
    assert one.state_dict()["position"] == wide.state_dict()["position"] == 16


def test_state_mismatch_is_refused():
    it = make()
    next(it)
    state = it.state_dict()
    # what may have changed, and the way out (a new user's tokenizer file had changed; the advice named
    # the data.* settings, which had not)
    with pytest.raises(DataError, match="different data .* the tokenizer's file changed .* checkpoint.resume=none"):
        make(n=8 * 40 + 2).load_state_dict(state)  # same windows, other fingerprint
    other_windows = TokenBatchIterator(
        TensorStream([torch.arange(8 * 50 + 1)], vocab_size=401, fingerprint={"sha256": "arange321"}),
        seq_len=8,
        micro_batch=4,
        seed=0,
    )
    with pytest.raises(DataError, match="40 windows.*50 windows"):
        other_windows.load_state_dict(state)
    with pytest.raises(DataError, match="malformed"):
        make().load_state_dict({"version": 1})
    with pytest.raises(DataError, match="out of range"):
        make().load_state_dict(dict(state, position=41))


def test_too_short_for_one_batch_per_rank():
    make(n=8 * 8 + 1, micro_batch=4, dp_size=2)  # exactly enough
    with pytest.raises(DataError, match=r"found 64 tokens, need at least 65"):
        make(n=64, micro_batch=4, dp_size=2)


@pytest.mark.parametrize("k", [0, 7, 13])
def test_resume_with_document_packing_gives_the_same_positions_and_masks(k):
    """Resumed mid-epoch under data.packing = document, the windows come back with the same positions
    (restarting at each document) and the same targets masked at each boundary."""
    n = 8 * 40 + 1
    starts = torch.tensor([0, 5, 19, 20, 61, 150, 151, 290])  # varied lengths, one of a single token

    def documents():
        stream = TensorStream([torch.arange(n)], vocab_size=n, fingerprint={"source": "test", "sha256": "docs"},
                              document_starts=starts)
        return TokenBatchIterator(stream, seq_len=8, micro_batch=4, seed=5, packing="document")

    it = documents()
    take(it, k)
    state = it.state_dict()
    expected = take(it, 12)  # crosses an epoch boundary
    resumed = documents()
    resumed.load_state_dict(state)
    got = take(resumed, 12)
    assert any((b.targets == -100).any() for b in expected) and any((b.positions[:, 1:] == 0).any() for b in expected)
    for want, have in zip(expected, got, strict=True):
        for field in ("inputs", "targets", "positions"):
            assert torch.equal(getattr(want, field), getattr(have, field)), field


def test_a_state_of_the_earlier_randperm_order_is_refused_by_name():
    it = make(seed=5)
    state = {**it.state_dict(), "version": 1}
    with pytest.raises(DataError, match=r"version 1 .*earlier accelrun, whose shuffled window order this one does not "
                                        r"reproduce.*checkpoint\.resume=none"):
        make(seed=5).load_state_dict(state)


def test_a_state_of_the_earlier_version_read_in_order_resumes():
    it = make(seed=5, shuffle=False)
    take(it, 3)
    state = {**it.state_dict(), "version": 1}  # the identity order is the same in both versions
    resumed = make(seed=5, shuffle=False)
    resumed.load_state_dict(state)
    assert windows(next(resumed)) == windows(next(it))
