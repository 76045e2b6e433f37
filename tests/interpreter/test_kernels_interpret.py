"""The Triton kernels under the Triton interpreter on CPU tensors, vs the float64 reference.

They need TRITON_INTERPRET=1 from the start of the process; without it conftest.py in
this directory reruns them in a child process that has it (CI has no GPU).
The interpreter mis-computes bf16 dots, so the kernels cast dot operands to fp32 when
they run on the CPU (DOT_FP32); bf16 cases still exercise bf16 loads and stores.
"""
import math
import os

import pytest
import torch

from helpers import oracle_bwd, relerr
from kernel_checks import TOL, Case, check_backward, check_forward, stand_in, trailing_lengths

# A guard: without the variable, conftest.py hands these tests to a child process before
# they run, so this skip is only reached if that hand-over was bypassed.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 set before triton is imported "
           "(tests/interpreter/conftest.py reruns these tests in a child process with it)")

BF, FP = torch.bfloat16, torch.float16
CASES = [
    Case(1, 1, 64, 5, 1, dtype=FP),
    Case(3, 3, 64, 20, 37, dtype=FP),
    Case(2, 70, 64, 30, 70, dtype=FP),  # two head blocks, tail head block
    Case(4, 5, 128, 50, 70, dtype=BF, ids="deepseek"),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="empty_rows"),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="empty_rows", sink=False),
    Case(4, 4, 64, 30, 40, dtype=FP, ids="dup"),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="extreme", idx_dtype=torch.int32),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="extreme", idx_dtype=torch.int64),
    Case(8, 4, 64, 30, 20, dtype=FP, ids="shared"),
    Case(4, 4, 64, 30, 20, dtype=FP, sink_scale=30.0),
    Case(4, 4, 64, 30, 20, dtype=FP, sink_scale=-30.0),
    Case(4, 4, 64, 30, 20, dtype=FP, noncontig=True, sink=False),
    Case(2, 2, 256, 30, 9, dtype=FP),
    Case(6, 4, 64, 30, 70, dtype=FP, lengths=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_interpreted(case):
    check_forward(case, "cpu")


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_backward_interpreted(case, deterministic):
    check_backward(case, "cpu", deterministic=deterministic)


def test_backward_without_grad_lse_interpreted():
    check_backward(Case(3, 4, 64, 30, 20, dtype=FP), "cpu", with_dlse=False)


def test_v32_layout_deterministic_fold_interpreted(monkeypatch):
    """The 576/512 layout's deterministic backward: its fold runs one 1024-column program a
    row (masked past column 576), and 256-column ones where a program holds several rows
    (three a row, the last masked): both cover all 576 columns once, against the float64
    oracle, and give the same bits, with fp32 and with 16-bit partial rows."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton
    from dsv4_sparse_attn.kernels import forward_triton as kfwd
    from kernel_checks import oracle_bwd, relerr

    torch.manual_seed(0)
    T, H, N, K, D, d_v = 3, 2, 12, 9, 576, 512
    q, kv = torch.randn(T, H, D).to(FP), torch.randn(N, D).to(FP)
    idx = torch.randint(-1, N + 1, (T, K), dtype=torch.int32)
    idx[:, 1] = idx[:, 0]  # a row selected twice by a token
    sink = torch.randn(H)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5, d_v=d_v)
    do = torch.randn(T, H, d_v).to(FP)
    rq, rkv, rs = oracle_bwd(do, None, q, kv, idx, sink, None, None, d_v)
    assert kbwd.fold_block_d(D) == 1024 and kbwd.fold_block_d(D, 4) == 256
    for partial16 in (False, True):
        results = []
        for tile in ((1, 8, 4), (1, 4, 4), (4, 4, 4)):
            monkeypatch.setattr(kbwd, "fold_tile", lambda N, n_sm, n_part=1, tile=tile: tile)
            gq, gkv, gs = kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                              main=backward_triton, deterministic=True, partial16=partial16)
            assert gkv.shape == (N, D)
            assert relerr(gq, rq) < 6e-3 and relerr(gkv, rkv) < 6e-3 and relerr(gs, rs) < 4e-3
            # the rope columns get dS^T Q only; every column of a selected row was written
            assert relerr(gkv[:, d_v:], rkv[:, d_v:]) < 6e-3
            results.append((gq, gkv, gs))
        assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))


def test_epilogue_kernel_interpreted():
    """The backward's last launch (``backward.epilogue``): grad_kv from the fp32 accumulator
    in kv's dtype (the fake column order undone; N not a multiple of its row block, D = 576
    in 64-column pieces), and grad_sink = -sum_t exp(sink - lse) * Delta by segments of
    SINK_SEG_T rows (the last partly masked; a head block partly masked), strided lse,
    non-finite sinks: as the float64 formula, IEEE cases included (-inf: zero; +inf with
    finite lse: infinite terms of both signs, NaN), summed by the last of its programs on
    the ticket, which ends at their count. grad_kv equal to the random accumulator's values
    element for element (an unwritten element would not be)."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels.hopper import fake_col

    torch.manual_seed(0)
    T, H = 3 * kbwd.SINK_SEG_T + 5, 5
    lse = torch.randn(T, 2 * H)[:, :H]  # rows 2H apart (the backward makes the last dim dense)
    delta = torch.randn(T, H)
    sink = torch.tensor([0.5, -1.0, float("-inf"), float("inf"), float("nan")])
    want_sink = -(torch.exp(sink.double()[None, :] - lse.double()) * delta.double()).sum(0)
    # the ticket and the fast mode's counters after it 16-byte aligned, as the kernels are
    # specialised for, whatever N * D
    for N, D, n in [(3, 7, 4), (5, 33, 9), (0, 64, 4)]:
        acc, counters = kbwd.zeroed_accumulator(N, D, n, "cpu")
        assert counters.data_ptr() % 16 == 0 and counters[4:].data_ptr() % 16 == 0
        assert acc.shape == (N, D) and acc.is_contiguous() and counters.shape == (n,)
    for N, D, fake in [(37, 64, True), (300, 576, False), (0, 64, True)]:
        acc, counters = kbwd.zeroed_accumulator(N, D, 4, "cpu")
        assert acc.eq(0).all() and counters.eq(0).all() and counters.dtype == torch.int32
        acc.copy_(torch.randn(N, D))
        cols = fake_col(torch.arange(D)) if fake else torch.arange(D)
        gkv, gs = kbwd.epilogue(acc, torch.float16, fake, sink, lse, delta, counters[:1])
        assert gkv.dtype == torch.float16 and gkv.shape == (N, D)
        torch.testing.assert_close(gkv, acc[:, cols].half(), rtol=0, atol=0)
        torch.testing.assert_close(gs.double(), want_sink, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert gs[2] == 0 and torch.isnan(gs[4])  # -inf sink: no gradient; NaN stays NaN
        n_programs = kbwd.triton.cdiv(T, kbwd.SINK_SEG_T) * kbwd.triton.cdiv(H, 16)
        assert counters[0] == n_programs  # every part's program took the ticket once
    # without a sink: grad_kv only; T = 0: grad_sink zeros
    acc, counters = kbwd.zeroed_accumulator(8, 64, 4, "cpu")
    gkv, gs = kbwd.epilogue(acc, torch.bfloat16, False, None, lse, delta, counters[:1])
    assert gkv.eq(0).all() and gs.numel() == 0 and counters[0] == 0
    gkv, gs = kbwd.epilogue(acc, torch.bfloat16, False, sink, lse[:0], delta[:0], counters[:1])
    assert gs.shape == (H,) and gs.eq(0).all()


def _deterministic_backward(T, H, N, K, D, id_hi, d_v=None):
    """A call of the deterministic backward (Triton main kernel) on fixed random fp16
    inputs: ids in [-1, id_hi) with slot 1 a duplicate of slot 0, a sink, no grad_lse;
    ``d_v``: values narrower than keys."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton
    from dsv4_sparse_attn.kernels import forward_triton as kfwd

    torch.manual_seed(0)
    q, kv = torch.randn(T, H, D).to(FP), torch.randn(N, D).to(FP)
    idx = torch.randint(-1, id_hi, (T, K), dtype=torch.int32)
    idx[:, 1] = idx[:, 0]
    sink = torch.randn(H)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5, d_v=d_v)
    do = torch.randn_like(out)
    return lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                       main=backward_triton, deterministic=True)


@pytest.mark.parametrize("tile, H, reversed_rows", [
    ((2, 4, 4), 3, True), ((8, 4, 4), 3, False), ((16, 8, 8), 3, True), ((4, 4, 4), 70, True),
    ((1, 4, 4), 70, False)])
def test_fold_tiles_give_the_same_bits_interpreted(monkeypatch, tile, H, reversed_rows):
    """The deterministic fold with several kv rows side by side (what long contexts get,
    ``backward.fold_tile``), N not a multiple of them, rows of different entry counts in a
    tile and most rows untouched, its programs in either row order (``FOLD_ROWS_REVERSED``):
    bitwise the gradients of one row per program in the default order, and rows no token
    selects stay zero. H = 70: two head-block parts per partial row (N_HB = 2)."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    run = _deterministic_backward(T=5, H=H, N=100, K=7, D=64, id_hi=40)  # rows 40..99 untouched
    one = run()
    monkeypatch.setattr(kbwd, "fold_tile", lambda N, n_sm, n_part=1: tile)
    monkeypatch.setattr(kbwd, "FOLD_ROWS_REVERSED", reversed_rows)
    many = run()
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    assert torch.all(many[1][40:] == 0) and many[1][:40].abs().sum() > 0


def test_fold_tile_rule():
    """One kv row a program up to FOLD_RUNS_MIN_ROWS rows an SM, eight entries a step where an
    entry is one partial row and four where it is two head-block parts (the same bytes in
    flight); beyond, four rows side by side; one row on the CPU; rows in reverse order."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    assert kbwd.fold_tile(5120, 132) == (1, 8, 4) and kbwd.fold_tile(5120, 132, 2) == (1, 4, 4)
    assert kbwd.fold_tile(40960, 132, 1) == (1, 8, 4) and kbwd.fold_tile(163840, 132, 2) == (4, 4, 4)
    assert kbwd.fold_tile(163840, 0) == (1, 8, 4)
    assert kbwd.FOLD_ROWS_REVERSED


def test_inversions_stay_on_the_callers_stream_off_cuda():
    """Off CUDA (here: the interpreter) there is no second stream: ``beside_stream`` is None
    and ``_on_stream(None)`` leaves the work where it is, so the CPU path is unchanged."""
    import torch

    from dsv4_sparse_attn.kernels import backward as kbwd

    assert kbwd.beside_stream(torch.device("cpu")) is None
    with kbwd._on_stream(None):
        x = torch.ones(3) * 2
    assert x.sum().item() == 6


def test_fold_by_entry_runs_where_rows_are_many(monkeypatch):
    """The fold by entry runs is the default beyond FOLD_RUNS_MIN_ROWS kv rows an SM, at
    any D (the rule takes none: D = 512 and 576 measured) (T = 131072's 163,840 rows on 132
    SMs, not T = 32768's 40,960), not on the CPU; FOLD_RUNS overrides the rule either way."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    assert kbwd.FOLD_RUNS is None and kbwd.FOLD_RUNS_MIN_ROWS == 512
    assert kbwd.fold_runs(163840, 132) and not kbwd.fold_runs(40960, 132)
    assert not kbwd.fold_runs(163840, 0)
    monkeypatch.setattr(kbwd, "FOLD_RUNS", True)
    assert kbwd.fold_runs(10, 0)
    monkeypatch.setattr(kbwd, "FOLD_RUNS", False)
    assert not kbwd.fold_runs(163840, 132)


@pytest.mark.parametrize("config, H, D, chunks", [((8, 4, 2, True), 3, 64, 1), ((4, 4, 3, False), 70, 64, 1),
                                                  ((8, 4, 1, False), 3, 64, 3), ((8, 4, 5, True), 2, 576, 2)])
def test_fold_by_entry_runs_gives_the_same_bits_interpreted(monkeypatch, config, H, D, chunks):
    """The fold cut by entries (``FOLD_RUNS``: runs of the sorted entries, each moved to a row
    start, UNROLL entries a step across row boundaries) against the fold by kv rows: the
    same gradients bit for bit, with rows of many and of one entry, duplicated and masked
    ids, two head-block parts (H = 70), chunks that continue each other's sums, runs more
    than the entries (2 programs for 1 SM's worth, here grids of 2-5 programs on 1 "SM"),
    D = 576 (masked past 576); rows no token selects stay zero."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton

    run = _deterministic_backward(T=5, H=H, N=100, K=7, D=D, id_hi=40,  # rows 40..99 untouched
                                  d_v=512 if D == 576 else None)
    if chunks > 1:  # (partial rows for 5 // chunks + 1 tokens: several chunks, one fold each)
        monkeypatch.setattr(kbwd, "PARTIAL_BYTES",
                            (5 // chunks + 1) * -(-H // 64) * backward_triton.partial_slots(7) * D * 4)
    monkeypatch.setattr(kbwd, "FOLD_RUNS", False)
    rows = run()
    monkeypatch.setattr(kbwd, "FOLD_RUNS", True)
    monkeypatch.setattr(kbwd, "FOLD_RUNS_CONFIG", config)
    runs = run()
    assert all(torch.equal(a, b) for a, b in zip(rows, runs))
    assert torch.all(runs[1][40:] == 0) and runs[1][:40].abs().sum() > 0


@pytest.mark.parametrize("width", [256, 128])
def test_fold_width_gives_the_same_bits_interpreted(monkeypatch, width):
    """The fold's columns a program (``FOLD_BLOCK_D``: whole 512-column rows by default)
    only split the columns, which are summed independently: bitwise the same gradients
    with half or quarter rows a program (duplicated and masked ids, two head-block parts)."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    assert kbwd.FOLD_BLOCK_D == 512
    run = _deterministic_backward(T=4, H=70, N=30, K=9, D=512, id_hi=31)
    whole = run()
    monkeypatch.setattr(kbwd, "FOLD_BLOCK_D", width)
    part = run()
    assert all(torch.equal(a, b) for a, b in zip(whole, part))
    assert whole[1].abs().sum() > 0


def test_launch_cache_is_shared_by_a_calls_chunks_only_interpreted(monkeypatch):
    """A main kernel with ``LAUNCH_CACHE`` (the Gluon one: its TMA descriptors and scratch
    made once a call) gets one cache dict for all the chunks of a call and a fresh one for
    the next call: a cache kept over calls would hand the kernel descriptors of tensors
    that are gone. The gradients are bitwise those of the launches without it."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton

    run = _deterministic_backward(T=5, H=3, N=30, K=9, D=64, id_hi=31)
    plain = run()
    monkeypatch.setattr(kbwd, "PARTIAL_BYTES", 2 * backward_triton.partial_slots(9) * 64 * 4)  # 3 chunks
    seen, launch = [], backward_triton.launch

    def cached_launch(*args, cache, **kwargs):
        seen.append(cache)
        cache.setdefault("chunks", 0)
        cache["chunks"] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(backward_triton, "LAUNCH_CACHE", True, raising=False)
    monkeypatch.setattr(backward_triton, "launch", cached_launch)
    first, second = run(), run()
    assert len(seen) == 6 and all(c is seen[0] for c in seen[:3]) and all(c is seen[3] for c in seen[3:])
    assert seen[0] is not seen[3] and seen[0]["chunks"] == 3 and seen[3]["chunks"] == 3
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, first, second))


@pytest.mark.parametrize("sort_entries", [1, 40, 10**6], ids=["chunk-a-sort", "chunks-2-a-sort", "one-sort"])
@pytest.mark.parametrize("lengths", [False, True, "longest-first"], ids=["full", "lengths", "longest-first"])
def test_chunked_deterministic_backward_gives_the_same_bits_interpreted(monkeypatch, sort_entries, lengths):
    """The deterministic backward in chunks of 2 tokens (T = 7: the last chunk short), their
    ids inverted one chunk a sort, two a sort (the last group short) or all at once: bitwise
    the gradients of one chunk, with masked, out-of-range and duplicated ids and per-token
    lengths (values past K and negative too), the chunks taking the tokens in token order
    or longest first (``backward.length_order``; then also against the float64 oracle)."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton
    from dsv4_sparse_attn.kernels import forward_triton as kfwd

    if lengths == "longest-first":
        monkeypatch.setattr(kbwd, "LENGTH_ORDER_MIN_BYTES", 0)
    torch_sort = torch.sort
    torch.manual_seed(0)
    T, H, N, K, D = 7, 3, 50, 9, 64
    q, kv = torch.randn(T, H, D).to(FP), torch.randn(N, D).to(FP)
    idx = torch.randint(-3, N + 5, (T, K), dtype=torch.int64)
    idx[:, 1] = idx[:, 0]
    length = torch.tensor([0, 3, 9, 20, -2, 5, 1], dtype=torch.int32) if lengths else None
    sink = torch.randn(H)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5, topk_length=length)
    do = torch.randn_like(out)

    def run():
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                   main=backward_triton, deterministic=True, topk_length=length)

    whole = run()
    per_token = backward_triton.partial_slots(K) * D * 4  # partial-row bytes of a token (one head block)
    monkeypatch.setattr(kbwd, "PARTIAL_BYTES", 2 * per_token)  # chunks of 2 tokens
    monkeypatch.setattr(kbwd, "SORT_ENTRIES", sort_entries)
    sorts, launch = [], backward_triton.launch
    monkeypatch.setattr(kbwd.torch, "sort", lambda *a, **k: sorts.append(1) or torch_sort(*a, **k))
    monkeypatch.setattr(backward_triton, "launch", lambda *a, **k: sorts.append(0) or launch(*a, **k))
    chunked = run()
    assert sorts.count(0) == 4 and sorts.count(1) == {1: 4, 40: 2, 10**6: 1}[sort_entries]
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert whole[1].abs().sum() > 0
    if lengths == "longest-first":
        assert kbwd.length_order(length, K).tolist() == [2, 3, 5, 1, 6, 0, 4]  # (ties in token order)
        rq, rkv, rs = oracle_bwd(do, None, q, kv, idx, sink, None, length)
        tol = TOL[FP]
        assert relerr(whole[0], rq) < tol["grad"] and relerr(whole[1], rkv) < tol["grad"]
        assert relerr(whole[2], rs) < tol["sink"]


def test_remainder_parts_sum_in_order_interpreted():
    """The fast mode's remainder tiles in parts (backward_gluon): how tiles are cut, and the
    sum of each tile's fp32 dQ parts in part order (bitwise a sequential fp32 sum), into
    grad_q's rows of that tile's token and head block only: in a launch of its own
    (``backward.sum_dq_parts``) and among the epilogue's programs, beside the conversion
    and grad_sink's parts (as the backward launches it)."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_gluon as G

    assert G._remainder_parts(4096, 132, 10, True) == (4092, 10)  # 4 tiles x 10 one-block parts
    assert G._remainder_parts(8192, 132, 18, True) == (8184, 9)  # 8 x 9 two-block parts
    assert G._remainder_parts(300, 132, 5, True) == (264, 3)
    assert G._remainder_parts(4092, 132, 10, True) == (4092, 1)  # whole rounds: nothing to cut
    assert G._remainder_parts(1000, 132, 2, True) == (1000, 1)  # 76 left: under two a program
    assert G._remainder_parts(100, 132, 10, True) == (100, 1)  # fewer tiles than programs
    # a launch of the remainder alone on every program (launch(in_order=True)): all parts
    assert G._remainder_parts(4, 132, 10, True) == (0, 10)
    assert G._remainder_parts(4096, 132, 10, False) == (4096, 1)
    T, H, D, n_hb, n_full, n_parts = 5, 100, 512, 2, 7, 3
    r = T * n_hb - n_full
    g = torch.Generator().manual_seed(0)
    dqf = torch.randn(r * n_parts, 64, D, generator=g)
    # (fp32 grad_q: the sums' bits themselves; the interpreter's bf16 conversion rounds
    # otherwise than the GPU's)
    dq = torch.full((T, H, D), float("nan"), dtype=torch.float32)
    kbwd.sum_dq_parts(kbwd.DqParts(dqf, dq, 0, n_full, n_parts, r, n_hb, 64))
    in_epilogue = torch.full_like(dq, float("nan"))
    acc, counters = kbwd.zeroed_accumulator(9, D, 4, "cpu")
    acc0, counters0 = kbwd.zeroed_accumulator(9, D, 4, "cpu")
    acc.copy_(torch.randn(9, D, generator=g))
    lse, delta = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    sink = torch.randn(H, generator=g)
    gkv, gs = kbwd.epilogue(acc, torch.float32, False, sink, lse, delta, counters[:1],
                            kbwd.DqParts(dqf, in_epilogue, 0, n_full, n_parts, r, n_hb, 64))
    assert torch.equal(gkv, acc)
    torch.testing.assert_close(gs, -(torch.exp(sink[None] - lse) * delta).sum(0), rtol=1e-5, atol=1e-5)
    want = torch.full_like(dq, float("nan"))
    parts = dqf.view(r, n_parts, 64, D)
    for i in range(r):
        tile = n_full + i
        t, hb = tile // n_hb, tile % n_hb
        acc = torch.zeros(64, D)
        for p in range(n_parts):
            acc = acc + parts[i, p]
        rows = min(64, H - 64 * hb)
        want[t, 64 * hb:64 * hb + rows] = acc[:rows].to(dq.dtype)
    for got in (dq, in_epilogue):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    # a launch of the remainder alone (launch(in_order=True)'s second): no whole tile, from
    # token 3 (tiles 6..9 of the call)
    rem = torch.full_like(dq, float("nan"))
    dqf4 = torch.randn(4 * n_parts, 64, D, generator=g)
    kbwd.epilogue(acc0, torch.float32, False, sink, lse, delta, counters0[:1],
                  kbwd.DqParts(dqf4, rem, 3, 0, n_parts, 4, n_hb, 64))
    for i in range(4):
        t, hb = 3 + i // n_hb, i % n_hb
        rows = min(64, H - 64 * hb)
        one = torch.zeros(64, D)
        for p in range(n_parts):
            one = one + dqf4.view(4, n_parts, 64, D)[i, p]
        assert torch.equal(rem[t, 64 * hb:64 * hb + rows], one[:rows])
    assert rem[:3].isnan().all()


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_backward_takes_unaligned_rows_interpreted(monkeypatch, deterministic):
    """q, kv and dO at a base 2 bytes off a 16-byte boundary and with a row stride that is
    not a multiple of 16 elements (what Triton specialises on; the Gluon kernel's 16-byte
    gathers do not compile without it): the main kernel gets aligned copies
    (``common.aligned16``) and the gradients match the oracle."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_triton
    from helpers import oracle_fwd

    T, H, D, N, K = 4, 4, 64, 30, 20
    g = torch.Generator().manual_seed(7)

    def unaligned(shape, pad):  # one element in (2 bytes off), rows `pad` elements apart
        width = math.prod(shape[1:])
        flat = torch.randn(1 + shape[0] * (width + pad), generator=g).to(FP)
        return flat[1:].view(shape[0], width + pad)[:, :width].unflatten(1, shape[1:])

    q, kv = unaligned((T, H, D), 8), unaligned((N, D), 8)
    do = unaligned((T, H, D), 8)
    assert q.data_ptr() % 16 and q.stride(0) % 16 and kv.stride(0) % 16 and do.data_ptr() % 16
    idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    out, lse = oracle_fwd(q, kv, idx, sink)
    out, lse = out.to(q.dtype), lse.float()
    seen = []
    launch = backward_triton.launch

    def spy(q_, kv_, idx_, do_, *a, **k):
        seen.append(all(x.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in x.stride()[:-1])
                        for x in (q_, kv_, do_)))
        return launch(q_, kv_, idx_, do_, *a, **k)

    monkeypatch.setattr(backward_triton, "launch", spy)
    gq, gkv, gs = kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5, main=backward_triton,
                                      deterministic=deterministic)
    rq, rkv, rs = oracle_bwd(do, None, q, kv, idx, sink)
    assert seen and all(seen)
    assert relerr(gq, rq) < TOL[FP]["grad"] and relerr(gkv, rkv) < TOL[FP]["grad"]
    assert relerr(gs, rs) < TOL[FP]["sink"]


@pytest.mark.parametrize("idx_dtype, noncontig, K",
                         [(torch.int32, False, 300), (torch.int64, True, 130), (torch.int32, False, 0)],
                         ids=["i32", "i64-strided", "K0"])
def test_delta_launch_finds_each_tokens_trailing_masked_slots_interpreted(idx_dtype, noncontig, K):
    """The Delta kernel's ``HAS_TRAIL`` output: 1 + each token's last slot with an id in
    [0, N) (0 where none is), over K not a multiple of its 128-slot steps, int32 and int64
    ids, a strided ids tensor, K = 0; Delta itself the same bits as without it."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from kernel_checks import make_indices

    T, H, N, D = 40, 5, 60, 64
    c = Case(T, H, D, N, K, ids="tails", idx_dtype=idx_dtype)
    idx = make_indices(c, "cpu")
    if noncontig:
        idx = torch.stack([idx, torch.zeros_like(idx)], 1)[:, 0]
    out, do = torch.randn(T, H, D).to(FP), torch.randn(T, H, D).to(FP)
    want = trailing_lengths(idx, N)

    def run(trail):
        delta = torch.empty(T, H)
        kbwd._bwd_delta_kernel[(T, 2)](
            out, do, delta, delta, idx, trail if trail is not None else delta, H, N, K, out.stride(0),
            out.stride(1), do.stride(0), do.stride(1), 0, idx.stride(0), D=D, BLOCK_H=4, HAS_DLSE=False,
            HAS_TRAIL=trail is not None)
        return delta

    trail = torch.full((T,), -7, dtype=torch.int32)
    delta = run(trail)
    assert trail.tolist() == want.tolist()
    assert torch.equal(delta, run(None))
    assert K == 0 or (0 < want.float().mean() < K and (want == 0).any() and (want == K).any())


@pytest.mark.parametrize("T, K, idx_dtype, noncontig",
                         [(40, 300, torch.int32, False), (17, 130, torch.int64, True),
                          (5, 0, torch.int32, False), (33, 600, torch.int32, False)],
                         ids=["i32", "i64-strided", "K0", "K600"])
def test_trailing_lengths_launch_interpreted(T, K, idx_dtype, noncontig):
    """``common.trailing_lengths`` (the forward's trailing-slots option): 1 + each token's
    last slot with an id in [0, N) (0 where none is), over T and K not multiples of its
    4-token, 256-slot blocks, int32 and int64 ids, a strided ids tensor, K = 0."""
    from dsv4_sparse_attn.kernels.common import trailing_lengths as launch_lengths
    from kernel_checks import make_indices

    N = 60
    idx = make_indices(Case(T, 4, 64, N, K, ids="tails", idx_dtype=idx_dtype), "cpu")
    if noncontig:  # rows apart and slots apart (the forward hands over the ids as given)
        idx = torch.stack([idx, torch.zeros_like(idx)], 1)[:, 0]
        idx = torch.stack([idx, torch.full_like(idx, 5)], 2).flatten(1)[:, ::2]
        assert idx.stride(1) == 2
    got = launch_lengths(idx, N)
    assert got.dtype == torch.int32 and got.tolist() == trailing_lengths(idx, N).tolist()


def _in_order_main(seen):
    """``backward_triton`` as a main kernel that takes ``in_order`` (``IN_ORDER``): the lengths
    the backward hands it go to the Triton kernel as given lengths (recorded in ``seen``)."""
    from dsv4_sparse_attn.kernels import backward_triton

    def launch(*a, in_order=False, topk_length=None, **k):
        seen.append((in_order, None if topk_length is None else topk_length.clone()))
        return backward_triton.launch(*a, topk_length=topk_length, **k)

    return stand_in(backward_triton, launch=launch, IN_ORDER=True)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_backward_skips_trailing_masked_slots_interpreted(monkeypatch, deterministic):
    """With ``TRAILING_MASKED_SKIPPED`` the backward without lengths hands a main kernel that
    takes ``in_order`` each token's trailing masked slots as its length (from the Delta
    launch): the gradients against the float64 oracle, and in the deterministic mode bitwise
    those of the call without it (the slots left out add nothing)."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import forward_triton as kfwd
    from kernel_checks import make_case

    c = Case(9, 4, 64, 40, 70, dtype=FP, ids="tails")
    q, kv, idx, sink = make_case(c, "cpu")
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5)
    do = torch.randn_like(out)
    seen = []
    main = _in_order_main(seen)

    def run():
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main,
                                   deterministic=deterministic)

    monkeypatch.setattr(kbwd, "TRAILING_MASKED_SKIPPED", False)
    plain = run()
    assert seen == [(False, None)] * len(seen) and seen
    monkeypatch.setattr(kbwd, "TRAILING_MASKED_SKIPPED", True)
    seen.clear()
    got = run()
    want = trailing_lengths(idx, c.N).to(torch.int32)
    assert seen and all(o and torch.equal(n, want) for o, n in seen)
    rq, rkv, rs = oracle_bwd(do, None, q, kv, idx, sink, None, None)
    tol = TOL[FP]
    assert relerr(got[0], rq) < tol["grad"] and relerr(got[1], rkv) < tol["grad"]
    assert relerr(got[2], rs) < tol["sink"]
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(plain, got))
