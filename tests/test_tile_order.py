"""The Gluon kernels' tile order with per-token lengths (``hopper.balanced_order``), on the
CPU: a permutation of each launch's tokens that spreads their lengths evenly over the
persistent programs."""
import pytest
import torch

from dsv4_sparse_attn.kernels.hopper import balanced_order


def _loads(order, length, programs, n_hb=1):
    """Each program's total length: program p takes tiles p, p + programs, ...; a token's
    n_hb tiles are consecutive."""
    load = torch.zeros(programs)
    tiles = [int(length[t]) for t in order.tolist() for _ in range(n_hb)]
    for i, work in enumerate(tiles):
        load[i % programs] += work
    return load


@pytest.mark.parametrize("T, chunk, programs, n_hb", [
    (20, 20, 6, 2), (23, 10, 6, 2), (7, 7, 4, 1), (4096, 4096, 132, 1), (1000, 264, 132, 2),
    (5, 100, 132, 1), (300, 132, 132, 1), (1, 1, 1, 1),
])
def test_each_launch_gets_a_permutation_of_its_tokens(T, chunk, programs, n_hb):
    g = torch.Generator().manual_seed(T + chunk)
    length = torch.randint(-3, 700, (T,), generator=g, dtype=torch.int32)
    order = balanced_order(length, chunk, programs, n_hb)
    assert order.dtype == torch.int32 and order.shape == (T,)
    for t0 in range(0, T, chunk):
        n = min(chunk, T - t0)
        assert sorted(order[t0:t0 + n].tolist()) == list(range(n)), t0


def test_snake_rounds_longest_first_and_the_last_round_left_to_right():
    length = torch.tensor([5, 9, 1, 7, 3, 8, 2], dtype=torch.int32)
    order = balanced_order(length, 7, 3, 1)
    # rounds of 3 tokens, longest first: [9 8 7] [5 3 2] [1]; the last round goes left to
    # right, the one before right to left, the first left to right again.
    assert length[order.long()].tolist() == [9, 8, 7, 2, 3, 5, 1]


def test_lengths_spread_evenly_over_the_programs():
    g = torch.Generator().manual_seed(1)
    length = torch.randint(128, 641, (4096,), generator=g, dtype=torch.int32)
    natural = _loads(torch.arange(4096), length, 132)
    balanced = _loads(balanced_order(length, 4096, 132, 1), length, 132)
    assert natural.max() / natural.mean() > 1.05  # what the order is for
    assert balanced.max() / balanced.mean() < 1.01
    paired = _loads(balanced_order(length, 4096, 132, 2), length, 132, n_hb=2)
    assert paired.max() / paired.mean() < 1.02


def test_one_tile_per_program_keeps_the_token_order():
    length = torch.randint(0, 100, (300,), dtype=torch.int32)
    order = balanced_order(length, 132, 132, 1)
    assert order.tolist() == [t % 132 for t in range(300)]
