"""A prototype of 16-bit partial rows for the deterministic fold (``P16`` in
``backward._dkv_reduce_kernel`` and ``_dkv_fold_runs_kernel``; not used by the backward
yet: docs/performance/backward.md#partial-rows-in-16-bits-cpu-precision-not-built): rows
of fp16 values with a power-of-two scale a 64-column segment fold to the same bits as the
fp32 rows they decode to, exactly, in both folds, with one and two head-block parts."""
from __future__ import annotations

import pytest
import torch
import triton


def _entries(T, K, N, seed):
    """A chunk's ids (some masked: keyed N, after every row) sorted by kv row as the
    backward sorts them: (sorted keys, positions, segment bounds [N + 1])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N, (T, K), generator=g)
    ids[torch.rand(T, K, generator=g) < 0.2] = N  # masked slots add nothing
    keys, order = torch.sort(ids.reshape(-1), stable=True)
    seg = torch.searchsorted(keys, torch.arange(N + 1))
    return keys.to(torch.int32), order.to(torch.int64), seg.to(torch.int64)


def _rows16(T, n_hb, K, D, seed):
    """fp16 partial rows, int8 scales in [-40, 20] a 64-column segment, and the fp32 rows
    they stand for (value = fp16 * 2^s: exact in fp32)."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(T, n_hb, K, D, generator=g) * 1e4).clamp(-6e4, 6e4).half()
    s = torch.randint(-40, 21, (T, n_hb, K, D // 64), generator=g, dtype=torch.int8)
    dec = v.float() * torch.exp2(s.float()).repeat_interleave(64, dim=-1)
    assert torch.equal(dec.double(), v.double() * torch.exp2(s.double()).repeat_interleave(64, dim=-1))
    return v, s, dec


@pytest.mark.parametrize("n_hb, D", [(1, 128), (2, 192)])
def test_fold_of_16_bit_rows_equals_the_fold_of_their_fp32_values(n_hb, D):
    from dsv4_sparse_attn.kernels import backward as kbwd

    T, K, N = 6, 9, 17
    keys, order, seg = _entries(T, K, N, seed=n_hb)
    v, s, dec = _rows16(T, n_hb, K, D, seed=D)
    acc0 = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    results = []
    for p16 in (False, True):
        part, exp = (v, s) if p16 else (dec, None)
        a = acc0.clone()
        kbwd._dkv_reduce_kernel[(triton.cdiv(N, 4), 1)](
            part, order, seg, a, K, K, N, D=D, BLOCK_D=triton.next_power_of_2(D), N_HB=n_hb,
            MASK_D=D != triton.next_power_of_2(D), ROWS=4, UNROLL=4, EXP=exp, P16=p16)
        b = acc0.clone()
        kbwd._dkv_fold_runs_kernel[(3,)](
            part, order, keys, seg, b, K, K, N, D=D, BLOCK_D=triton.next_power_of_2(D), N_HB=n_hb,
            UNROLL=4, PRELOAD=True, EXP=exp, P16=p16)
        results += [a, b]
    ref = acc0.double().clone()
    flat = dec.double().sum(1).reshape(T * K, D)  # (parts in order: exact in float64 here)
    live = keys < N
    ref.index_add_(0, keys[live].long(), flat[order[live]])
    assert (results[0].double() - ref).abs().max() < 1e-3 * ref.abs().max()  # (the fold's own fp32 sum)
    assert all(torch.equal(results[0], r) for r in results[1:])
