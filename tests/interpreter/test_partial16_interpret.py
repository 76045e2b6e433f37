"""16-bit partial rows for the deterministic fold (``P16`` in ``backward._dkv_reduce_kernel``
and ``_dkv_fold_runs_kernel``; the default with the Gluon main kernel, on the GPU; here the
Triton one's: docs/performance/backward.md#partial-rows-in-16-bits): rows
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


def _rows16(T, n_hb, K, D, seed, rope=False):
    """fp16 partial rows, scales 2^s with s in [-40, 20] a segment (packed), and the fp32
    rows they stand for (value = fp16 * 2^s: exact in fp32). Segments of 64 columns; with
    ``rope`` the last 64 columns are two of 32 (``backward._scaled``, ``P16 == 2``)."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(T, n_hb, K, D, generator=g) * 1e4).clamp(-6e4, 6e4).half()
    widths = torch.tensor([64] * (D // 64 - rope) + [32, 32] * rope)
    s = torch.randint(-40, 21, (T, n_hb, K, len(widths)), generator=g, dtype=torch.int8)
    per_col = s.float().repeat_interleave(widths, dim=-1)
    dec = v.float() * torch.exp2(per_col)
    assert torch.equal(dec.double(), v.double() * torch.exp2(per_col.double()))
    return v, pack_scales(s), dec


def pack_scales(s):
    """int8 scales [..., segments] as the kernels hold them: biased exponent bytes s + 127 in
    int64 words, a byte a segment (the spare bytes of the last word random: never read)."""
    n_words = -(-s.shape[-1] // 8)
    b = torch.randint(0, 256, (*s.shape[:-1], 8 * n_words), dtype=torch.uint8)
    b[..., :s.shape[-1]] = (s.to(torch.int32) + 127).to(torch.uint8)
    return b.view(torch.int64)


@pytest.mark.parametrize("n_hb, D, rope", [(1, 128, False), (2, 192, False), (2, 576, False), (1, 576, True),
                                           (2, 320, True), (1, 128, True)])
def test_fold_of_16_bit_rows_equals_the_fold_of_their_fp32_values(n_hb, D, rope):
    """``rope``: rows that end in 64 score-only columns (the 576/512 layout, or d_v + 64),
    those scaled as two segments of 32 (``P16 == 2``)."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    T, K, N = 6, 9, 17
    keys, order, seg = _entries(T, K, N, seed=n_hb)
    v, s, dec = _rows16(T, n_hb, K, D, seed=D, rope=rope)
    assert s.shape[-1] == kbwd.scale_words(D, rope)
    acc0 = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    results = []
    for p16 in (False, 2 if rope else 1):
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


@pytest.mark.parametrize("n_hb, D", [(1, 128), (2, 512)])
def test_fold_of_bf16_rows_equals_the_fold_of_their_fp32_values(n_hb, D):
    """bf16 rows without scales (``P16 == 3``: ``backward.PARTIAL_16_BF16``, a measurement
    option) fold, in both folds, to the bits of the fp32 rows they widen to (exact); the
    scale words passed beside them are never read (garbage here)."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    T, K, N = 6, 9, 17
    keys, order, seg = _entries(T, K, N, seed=5)
    g = torch.Generator().manual_seed(D)
    v = (torch.randn(T, n_hb, K, D, generator=g) * torch.exp2(torch.randint(-30, 30, (T, n_hb, K, 1),
                                                                            generator=g).float())).bfloat16()
    junk = torch.randint(-2**62, 2**62, (T, n_hb, K, 1), generator=g, dtype=torch.int64)
    acc0 = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    results = []
    for p16 in (False, 3):
        part, exp = (v, junk) if p16 else (v.float(), None)
        a = acc0.clone()
        kbwd._dkv_reduce_kernel[(triton.cdiv(N, 4), 1)](
            part, order, seg, a, K, K, N, D=D, BLOCK_D=D, N_HB=n_hb, MASK_D=False, ROWS=4, UNROLL=4,
            EXP=exp, P16=p16)
        b = acc0.clone()
        kbwd._dkv_fold_runs_kernel[(3,)](
            part, order, keys, seg, b, K, K, N, D=D, BLOCK_D=D, N_HB=n_hb, UNROLL=4, PRELOAD=True,
            EXP=exp, P16=p16)
        results += [a, b]
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("H, D, rope", [(3, 256, False), (70, 256, False), (3, 512, True)])
def test_deterministic_backward_with_16_bit_rows(monkeypatch, H, D, rope):
    """The deterministic backward (Triton main kernel) with 16-bit partial rows against the
    same with fp32 rows: grad_q and grad_sink bitwise equal (the rows do not enter them),
    grad_kv within fp16's rounding of each row (2^-11 of a segment's largest value), and the
    same bits whatever the chunks. ``rope``: the 576/512 layout's 64 score-only columns."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton
    from dsv4_sparse_attn.kernels import forward_triton as kfwd

    torch.manual_seed(1)
    T, N, K = 5, 30, 7
    W = D + 64 if rope else D
    q, kv = torch.randn(T, H, W).half(), torch.randn(N, W).half()
    idx = torch.randint(-1, N, (T, K), dtype=torch.int32)
    idx[:, 1] = idx[:, 0]
    sink = torch.randn(H)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, W ** -0.5, d_v=D if rope else None)
    do = torch.randn_like(out)

    def run(p16):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, W ** -0.5, main=backward_triton,
                                   deterministic=True, partial16=p16)

    ref, got = run(False), run(True)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[2], got[2])
    err = (got[1].float() - ref[1].float()).norm() / ref[1].float().norm()
    assert 0 < err < 2e-3, err
    monkeypatch.setattr(kbwd, "PARTIAL_BYTES", 2 * H * K * W * 4)  # (two or three tokens a chunk)
    again = run(True)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_16_bit_rows_need_the_deterministic_partial_rows():
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton

    q, kv = torch.randn(2, 3, 64).half(), torch.randn(8, 64).half()
    idx = torch.zeros(2, 4, dtype=torch.int32)
    lse, do = torch.zeros(2, 3), torch.randn(2, 3, 64).half()
    with pytest.raises(ValueError, match="16-bit partial rows"):
        kbwd.sparse_mla_bwd(do, None, q, kv, do, lse, idx, None, 0.125, main=backward_triton,
                            deterministic=False, partial16=True)


@pytest.mark.parametrize("case", ["T5-H3-D256-N30-K7-dup", "T4-H70-D256-N20-K9-empty_rows",
                                  "T5-H3-D256-N30-K7-extreme-len"], ids=str)
def test_16_bit_rows_against_the_float64_oracle(case):
    """The deterministic backward with 16-bit partial rows against the float64 oracle
    (grad_q poisoned, grad_lse and grad_sink included; masked, duplicated and out-of-range
    ids, empty rows, extreme sinks, per-token lengths)."""
    from kernel_checks import Case, check_backward

    T, H, D, N, K, ids, *rest = case.split("-")
    c = Case(int(T[1:]), int(H[1:]), int(D[1:]), int(N[1:]), int(K[1:]), ids=ids, lengths="len" in rest,
             dtype=torch.float16, sink_scale=30.0 if ids == "extreme" else 1.0)
    check_backward(c, "cpu", deterministic=True, partial16=True)


_DEFAULT_CASES = [(True, True, True, torch.float16), (False, True, True, torch.float32),
                  (True, False, True, torch.float32), (True, True, False, None)]


@pytest.mark.parametrize("flag, default, deterministic, want", _DEFAULT_CASES,
                         ids=["default", "PARTIAL_16-off", "kernel-without", "fast-mode"])
def test_16_bit_rows_are_the_default_where_the_main_kernel_says(monkeypatch, flag, default, deterministic,
                                                                want):
    """``sparse_mla_bwd(partial16=None)`` takes 16-bit rows where ``backward.PARTIAL_16`` is on
    and the main kernel's ``partial16_default`` says so (the Gluon kernel at D = 512 and at
    576/512), fp32 rows otherwise, and none in the fast mode: the
    rows the main kernel is handed."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton
    from kernel_checks import stand_in

    seen = []

    def launch(*args, **kw):
        seen.append(None if args[8] is None else args[8].dtype)
        return backward_triton.launch(*args, **kw)

    main = stand_in(backward_triton, launch=launch, partial16_default=lambda W, D: default)
    monkeypatch.setattr(kbwd, "PARTIAL_16", flag)
    torch.manual_seed(0)
    q, kv = torch.randn(3, 2, 256).half(), torch.randn(10, 256).half()  # (D / 4 a multiple of 64)
    idx = torch.randint(0, 10, (3, 5), dtype=torch.int32)
    lse, do = torch.randn(3, 2), torch.randn(3, 2, 256).half()
    kbwd.sparse_mla_bwd(do, None, q, kv, do, lse, idx, None, 0.1, main=main, deterministic=deterministic)
    assert seen and all(d == want for d in seen), seen


@pytest.mark.parametrize("n_hb, rows", [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_fold_of_rows_in_the_sorted_layout(n_hb, rows):
    """The sorted layout (``backward.FOLD_IN_MAIN``): each entry's rows at its rank in the
    chunk's sorted order plus one (``_Inverter(ranks=True)``), head-block parts adjacent, row
    0 of each part spare; the fold by rows (``SORTED``) reads them in order and gives the bits
    of the fold of the same rows in the (token, part, slot) layout; one and several rows a
    program."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    T, K, N, D = 6, 9, 17, 128
    keys, order, seg = _entries(T, K, N, seed=7 + n_hb)
    v, s, _ = _rows16(T, n_hb, K, D, seed=n_hb)
    # ranks as the inversion makes them (rank[order[e]] = e + 1), and the rows placed by them
    rank = torch.empty(T * K, dtype=torch.int32).scatter_(
        0, order, torch.arange(1, T * K + 1, dtype=torch.int32))
    sorted_rows = torch.full(((T * K + 1) * n_hb, D), float("nan")).half()
    sorted_exp = torch.randint(-2**62, 2**62, ((T * K + 1) * n_hb, 1), dtype=torch.int64)
    for e in range(T * K):
        for p in range(n_hb):
            sorted_rows[rank[e] * n_hb + p] = v[e // K, p, e % K]
            sorted_exp[rank[e] * n_hb + p] = s[e // K, p, e % K]
    acc0 = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    a, b = acc0.clone(), acc0.clone()
    kbwd._dkv_reduce_kernel[(triton.cdiv(N, rows), 1)](
        v, order, seg, a, K, K, N, D=D, BLOCK_D=D, N_HB=n_hb, MASK_D=False, ROWS=rows, UNROLL=4, EXP=s, P16=1)
    kbwd._dkv_reduce_kernel[(triton.cdiv(N, rows), 1)](
        sorted_rows, seg, seg, b, K, K, N, D=D, BLOCK_D=D, N_HB=n_hb, MASK_D=False, ROWS=rows, UNROLL=4,
        EXP=sorted_exp, P16=1, SORTED=True)
    assert torch.equal(a, b)
    assert not torch.equal(a, acc0)


def test_inversion_ranks_invert_the_sorted_order():
    """``_Inverter(ranks=True)`` gives each chunk's entries their rank in the sorted order
    plus one (the sorted layout's row), a permutation of 1 .. chunk x K."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    T, K, N, chunk = 10, 5, 13, 4
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, N, (T, K), generator=g, dtype=torch.int32)
    inv = kbwd._Inverter(idx, None, None, T, chunk, K, N, None, ranks=True)
    sorted_ids, order, seg, rank = inv.wait(inv(0, 3))
    for c in range(3):
        assert torch.equal(torch.sort(rank[c]).values, torch.arange(1, chunk * K + 1, dtype=torch.int32))
        assert torch.equal(rank[c][order[c]], torch.arange(1, chunk * K + 1, dtype=torch.int32))


@pytest.mark.parametrize("mode", [True, "beside", "chain"])
def test_fold_in_main_chunk_plumbing(monkeypatch, mode):
    """``backward.FOLD_IN_MAIN``'s host side (the Gluon kernel itself runs on the GPU only:
    tests/test_kernels_gpu.py): with a stand-in main kernel that records its launches, each
    chunk gets its own ranks and one of two sorted-layout buffers in turn, chunk c's launch
    folds chunk c - 1's rows (buffer, scales, sorted ids and segments), the first folds
    nothing, and the fold by rows (``_dkv_reduce_kernel(SORTED=True)``) takes the last
    chunk alone; with ``"beside"`` no launch folds and every chunk is folded after its own.
    ``"chain"`` (``FOLD_CHAIN``): three buffers in turn, and each launch's counters' targets:
    two stores a program of the chunk before, the programs that folded chunks c - 2 and c - 3."""
    import types

    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton as real

    T, H, D, N, K, chunk = 10, 4, 64, 11, 5, 3
    launches, folds = [], []

    def launch(q, kv, idx, do, lse, delta, grad_q, acc, partial, flags, t_begin, n_tok, *args, **kw):
        grad_q[t_begin:t_begin + n_tok] = 0
        fold = kw.get("fold")
        chain = kw.get("chain")
        launches.append(dict(t_begin=t_begin, n_tok=n_tok, partial=partial.data_ptr(),
                             shape=tuple(partial.shape), ranks=tuple(kw["ranks"].shape),
                             fold=None if fold is None else fold[0].data_ptr(),
                             chain=None if chain is None else tuple(chain[1:]), programs=kw.get("programs")))

    main = types.SimpleNamespace(
        NAME="stand-in", PARTIAL_16=True, ACC_FAKE_ORDER=False, tile_heads=real.tile_heads,
        partial_slots=real.partial_slots, pairs_head_blocks=real.pairs_head_blocks,
        flags_per_chunk=real.flags_per_chunk, folds_in_main=lambda W, dv: True, launch=launch)
    real_fold = kbwd._dkv_reduce_kernel

    class Fold:
        def __getitem__(self, grid):
            def run(part, order, seg, *args, **kw):
                folds.append(dict(partial=part.data_ptr(), sorted=kw.get("SORTED", False)))
                return real_fold[grid](part, order, seg, *args, **kw)
            return run

    monkeypatch.setattr(kbwd, "_dkv_reduce_kernel", Fold())
    monkeypatch.setattr(kbwd, "FOLD_IN_MAIN", True if mode == "chain" else mode)
    monkeypatch.setattr(kbwd, "FOLD_CHAIN", mode == "chain")
    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)
    # (chunks of 3 tokens: the budget's half (chained: third), in 16-bit rows' terms)
    n_bufs = 3 if mode == "chain" else 2
    monkeypatch.setattr(kbwd, "PARTIAL_BYTES", -(-chunk * K * D * 4 * n_bufs * 129 // 256))
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(T, H, D, generator=g).half(), torch.randn(N, D, generator=g).half()
    idx = torch.randint(-1, N, (T, K), generator=g, dtype=torch.int32)
    out, do = torch.randn(T, H, D, generator=g).half(), torch.randn(T, H, D, generator=g).half()
    lse = torch.randn(T, H, generator=g)
    kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, None, D ** -0.5, main=main, partial16=True)
    n_chunks = -(-T // chunk)
    want = [(c * chunk, min(chunk, T - c * chunk)) for c in range(n_chunks)]
    assert [(x["t_begin"], x["n_tok"]) for x in launches] == want
    assert all(x["shape"] == ((chunk * K + 1) * 1, D) and x["ranks"] == (chunk * K, ) for x in launches)
    bufs = [x["partial"] for x in launches]
    assert all(len(set(bufs[i::n_bufs])) == 1 for i in range(n_bufs)) and len(set(bufs[:n_bufs])) == n_bufs
    assert all(f["sorted"] for f in folds)
    if mode == "chain":  # (no GPU: a program a tile; H = 4, one head block)
        grids = [x["n_tok"] for x in launches]
        assert [x["programs"] for x in launches] == grids
        assert [x["chain"] for x in launches] == [
            (c, 2 * grids[c - 1] if c else 0, grids[c - 1] if c >= 2 else 0, grids[c - 2] if c >= 3 else 0,
             c > 0) for c in range(n_chunks)]
    else:
        assert all(x["chain"] is None for x in launches)
    if mode == "beside":
        assert all(x["fold"] is None for x in launches)
        assert [f["partial"] for f in folds] == bufs
    else:
        assert launches[0]["fold"] is None
        assert [x["fold"] for x in launches[1:]] == bufs[:-1]
        assert [f["partial"] for f in folds] == bufs[-1:]
