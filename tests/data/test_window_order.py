"""WindowOrder: the loader's shuffled order of windows, computed per position instead of stored."""

from __future__ import annotations

import pytest
import torch

from accelrun.data.window_order import CHUNK, WindowOrder


@pytest.mark.parametrize("n", [1, 2, 3, 7, 40, 1000, 65_537, 300_007])
def test_every_window_once(n):
    got = WindowOrder(n, "shuffle", 3, 0).at(torch.arange(n))
    assert torch.equal(got.sort().values, torch.arange(n))


def test_the_seed_and_epoch_pick_the_order_and_nothing_else():
    n = 5_000
    orders = {(s, e): WindowOrder(n, "shuffle", s, e).at(torch.arange(n)) for s in (0, 1) for e in (0, 1)}
    again = WindowOrder(n, "shuffle", 0, 0).at(torch.arange(n))
    assert torch.equal(orders[0, 0], again)
    values = list(orders.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert (values[i] != values[j]).float().mean() > 0.99  # independent orders, not shifted copies
    assert not torch.equal(orders[0, 0], torch.arange(n))
    assert torch.equal(WindowOrder(n, "shuffle", 0, 0, shuffle=False).at(torch.arange(n)), torch.arange(n))


def test_windows_read_together_come_from_all_over_the_corpus():
    n = 1 << 20
    first = WindowOrder(n, "shuffle", 0, 0).at(torch.arange(10_000)).double() / n
    assert abs(first.mean() - 0.5) < 0.01 and abs(first.std() - 12 ** -0.5) < 0.01  # uniform over [0, 1)
    lag = torch.corrcoef(torch.stack([first[:-1], first[1:]]))[0, 1]
    assert abs(lag) < 0.05


def test_slices_cross_chunks_as_positions_do():
    order = WindowOrder(3 * CHUNK + 5, "shuffle", 9, 2)
    for start, stop in [(0, 7), (CHUNK - 3, CHUNK + 4), (2 * CHUNK - 1, 3 * CHUNK + 5), (10, 10)]:
        assert order.slice(start, stop) == order.at(torch.arange(start, stop)).tolist()


def test_a_corpus_of_any_size_costs_no_memory():
    """10^13 windows (a 10-quadrillion-token corpus at seq_len 1,000): a step's windows without a table."""
    n = 10**13
    order = WindowOrder(n, "shuffle", 0, 0)
    got = order.at(torch.arange(n - 64, n))
    assert got.numel() == 64 and bool(((got >= 0) & (got < n)).all()) and len(set(got.tolist())) == 64
