"""Triton kernels on the GPU vs the float64 reference. Skipped (with the reason) without CUDA."""
from __future__ import annotations

import pytest
import torch

import dsv4_sparse_attn
from kernel_checks import TOL, Case, check_backward, check_forward, make_case, make_lengths
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_triton, dispatch
from dsv4_sparse_attn.kernels import forward_triton as kfwd
from dsv4_sparse_attn.kernels.common import Call
from dsv4_sparse_attn.kernels.forward_gluon import MIN_HEADS as GLUON_FWD_MIN_HEADS
from helpers import deepseek_indices, oracle_bwd, oracle_fwd, relerr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)"),
]
DEV = "cuda"

BF, FP = torch.bfloat16, torch.float16
I32, I64 = torch.int32, torch.int64

CASES = [
    # edge sizes
    Case(1, 1, 64, 5, 1),
    Case(1, 128, 512, 300, 1152, ids="deepseek"),
    Case(3, 3, 512, 50, 37),
    Case(7, 16, 512, 200, 100),
    Case(5, 64, 512, 700, 640, ids="deepseek"),
    Case(4, 128, 512, 300, 130),
    Case(9, 70, 256, 90, 65),
    Case(6, 33, 128, 40, 17, sink=False),
    Case(6, 128, 64, 40, 200),
    # index edge cases
    Case(8, 64, 512, 100, 96, ids="empty_rows"),
    Case(8, 64, 512, 100, 96, ids="empty_rows", sink=False),
    Case(8, 64, 512, 100, 96, ids="dup"),
    Case(8, 64, 512, 100, 96, ids="extreme", idx_dtype=I32),
    Case(8, 64, 512, 100, 96, ids="extreme", idx_dtype=I64),
    Case(8, 64, 512, 40000, 96, ids="extreme", idx_dtype=I64),  # N >= 2**15: int32 sort keys
    Case(64, 64, 512, 100, 80, ids="shared"),
    # sinks, dtypes, layouts
    Case(8, 64, 512, 100, 96, sink_scale=30.0),
    Case(8, 64, 512, 100, 96, sink_scale=-30.0),
    Case(8, 64, 512, 100, 96, dtype=FP),
    Case(8, 20, 256, 100, 50, dtype=FP, idx_dtype=I64),
    Case(8, 64, 512, 100, 96, noncontig=True),
    Case(8, 5, 128, 100, 33, noncontig=True, sink=False),
    # per-token lengths
    Case(8, 64, 512, 100, 96, ids="dup", lengths=True),
    Case(9, 70, 256, 90, 65, lengths=True, sink=False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_reference(case):
    check_forward(case, DEV)


_GLUON_EXTRA = [
    Case(3, 192, 512, 100, 200, ids="deepseek"),   # three head blocks
    Case(2, 100, 512, 60, 1),                      # K = 1, a partial head block
    Case(5, 64, 512, 2000, 1000, ids="deepseek", sink=False),
    # more tiles than SMs: the persistent kernel's programs walk several tiles each
    Case(300, 128, 512, 700, 300, ids="deepseek"),
    Case(400, 64, 512, 500, 1, sink=False),
    Case(400, 64, 512, 50, 0),  # K = 0: every row empty, tiles must still hand q over
    # fewer heads than a tile's 64 rows (padding rows masked)
    Case(5, 24, 512, 300, 640, ids="deepseek"),
    # K % 128 in [1, 64] without lengths: the last pair's odd block is skipped (DEAD build)
    Case(300, 64, 512, 700, 160, ids="deepseek"),
    Case(7, 128, 512, 90, 64, ids="dup", sink=False),
    Case(200, 40, 512, 300, 130, ids="deepseek"),
    # per-token lengths: tiles of different block counts in one program (running phases)
    Case(300, 128, 512, 700, 300, ids="deepseek", lengths=True),
    Case(400, 64, 512, 500, 200, lengths=True, sink=False),
    Case(200, 40, 512, 300, 130, ids="deepseek", lengths=True),
    # one head block, K >= SPLIT_DET_MIN_K, many tiles, lengths: the deterministic split 1
    Case(300, 64, 512, 900, 640, ids="deepseek", lengths=True),
]
# The shapes the dispatcher gives each Gluon kernel: the forward from MIN_HEADS, the
# backward's main kernel at any H (deterministic) and from MIN_ATOMIC_HEADS (atomic); the
# backward's kernel is tested at every H in both modes.
GLUON_CASES = [c for c in CASES if c.D == 512 and c.H >= GLUON_FWD_MIN_HEADS] + _GLUON_EXTRA
GLUON_BWD_CASES = [c for c in CASES if c.D == 512] + _GLUON_EXTRA + [
    Case(64, 8, 512, 100, 80, ids="shared"),
    Case(8, 1, 512, 100, 96, ids="dup"),
    Case(300, 16, 512, 700, 300, ids="deepseek"),
]


def test_gluon_kernels_run_on_hopper():
    """On an H100/H200 both Gluon kernels take the D = 512 and 576/512 layouts: the Gluon
    tests below skip where a kernel's rule rejects a call, and this keeps those skips from
    hiding, on the one machine that runs them, a Triton without Gluon's Hopper API."""
    from dsv4_sparse_attn.kernels import backward_gluon, forward_gluon, hopper

    reason = hopper.not_sm90(torch.device(DEV))
    if reason:
        pytest.skip(f"not a Hopper GPU: {reason}")
    assert hopper.gluon_unavailable() is None
    for D, d_v in ((512, 0), (576, 512)):  # (d_v 0: values as wide as keys)
        call = Call(torch.device(DEV), BF, D, 64, True, d_v)
        assert forward_gluon.rejects(call) is None and backward_gluon.rejects(call) is None, (D, d_v)


@pytest.mark.parametrize("case", GLUON_CASES, ids=str)
def test_gluon_forward_matches_reference(case):
    from dsv4_sparse_attn.kernels import forward_gluon

    reason = forward_gluon.rejects(Call.of(torch.empty(1, case.H, case.D, device=DEV, dtype=case.dtype)))
    if reason:
        pytest.skip(f"the Gluon forward does not run here: {reason}")
    check_forward(case, DEV, fwd=forward_gluon.sparse_mla_fwd)


# The Gluon forward at D = 576, d_v = 512 (ROPE = 64), called directly: (T, H, N, K, ids, lengths,
# sink). Masked ids (< 0 and >= N), rows past H (H = 40, 100), K = 0 and 1, more tiles than
# SMs, lengths past K and negative, pairs whose odd block is past the length.
_GLUON_V32 = [
    (9, 64, 700, 640, "deepseek", False, True),
    (8, 64, 100, 96, "extreme", False, False),
    (5, 40, 300, 130, "deepseek", False, True),
    (2, 100, 60, 1, "random", False, True),
    (400, 64, 50, 0, "random", False, True),
    (300, 128, 700, 300, "deepseek", False, False),
    (9, 64, 700, 640, "deepseek", True, True),
    (300, 128, 700, 300, "deepseek", True, True),
]


@pytest.mark.parametrize("shape", _GLUON_V32, ids=lambda c: "-".join(map(str, c)))
def test_gluon_forward_v32_matches_reference(shape):
    """The 576/512 layout on the Gluon forward against the float64 oracle
    (docs/performance/forward.md#the-576512-layout-in-gluon)."""
    from dsv4_sparse_attn.kernels import forward_gluon

    T, H, N, K, ids, lengths, with_sink = shape
    reason = forward_gluon.rejects(Call(torch.device(DEV), BF, 576, H, True, 512, lengths))
    if reason:
        pytest.skip(f"the Gluon forward does not run here: {reason}")
    torch.manual_seed(0)
    q = torch.randn(T, H, 576, device=DEV).to(BF)
    kv = torch.randn(N, 576, device=DEV).to(BF)
    if ids == "deepseek":
        idx = deepseek_indices(T, K, n_pool=max(N - T, 1), device=DEV).clamp(max=N - 1)
    elif ids == "extreme":
        idx = torch.randint(-3, N + 3, (T, K), device=DEV, dtype=I32)
        idx[:, ::7] = torch.iinfo(torch.int32).max
        idx[:, 1::7] = torch.iinfo(torch.int32).min
    else:
        idx = torch.randint(0, N, (T, K), device=DEV, dtype=I32)
    length = None
    if lengths:
        length = torch.randint(-2, K + 70, (T,), device=DEV, dtype=I32)
        length[:4] = torch.tensor([0, 64, 65, K], dtype=I32)[:T]
    sink = torch.randn(H, device=DEV) if with_sink else None
    out = torch.full((T, H, 512), float("nan"), device=DEV, dtype=BF)  # every element must be written
    lse = torch.full((T, H), float("nan"), device=DEV)
    forward_gluon.sparse_mla_fwd(q, kv, idx, sink, 576 ** -0.5, out=out, lse=lse, topk_length=length, d_v=512)
    ro, rl = oracle_fwd(q, kv, idx, sink, 576 ** -0.5, length, 512)
    assert relerr(out, ro) < 2e-2 and relerr(lse, rl) < 1e-3, (relerr(out, ro), relerr(lse, rl))


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_backward_matches_reference(case, deterministic):
    check_backward(case, DEV, deterministic=deterministic)


def _gluon_bwd_or_skip(H=64, D=512):
    """The Gluon backward module, or a skip with the reason it does not run here."""
    from dsv4_sparse_attn.kernels import backward_gluon

    reason = backward_gluon.rejects(Call.of(torch.empty(1, H, D, device=DEV, dtype=BF)))
    if reason:
        pytest.skip(f"the Gluon backward does not run here: {reason}")
    return backward_gluon


def _main(gluon: bool):
    return _gluon_bwd_or_skip() if gluon else backward_triton


# every default of the Gluon backward's schedule (``backward_gluon._split``)
_SPLIT_ATTRS = ("SPLIT_ROLES", "SPLIT_ROLES_DET", "SPLIT_ROLES_DET_ONE_HB")


def _force_split(monkeypatch, main, split: int):
    """Every launch of ``main`` (the Gluon backward) in schedule ``split``, both modes."""
    for name in _SPLIT_ATTRS:
        monkeypatch.setattr(main, name, split)


def _assert_det_bitwise(monkeypatch, main, case, before: dict, after: dict):
    """The deterministic backward of ``case`` (its lengths, with grad_lse) with the
    attributes ``before`` set on ``main``, then with ``after``: bitwise equal gradients."""
    q, kv, idx, sink = make_case(case, DEV)
    length = make_lengths(case, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, case.D ** -0.5, topk_length=length)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def run(attrs):
        for name, value in attrs.items():
            monkeypatch.setattr(main, name, value)
        return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, case.D ** -0.5, main=main,
                                   topk_length=length)

    ref = run(before)
    assert all(torch.equal(a, b) for a, b in zip(ref, run(after)))


@pytest.mark.parametrize("case", GLUON_BWD_CASES + [Case(64, 128, 512, 300, 256, ids="shared")], ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_gluon_backward_matches_reference(case, deterministic):
    check_backward(case, DEV, deterministic=deterministic, main=_gluon_bwd_or_skip(case.H))


# Each token's slots from a cut on masked (ids="tails", as a causal indexer's): with
# TRAILING_MASKED_SKIPPED the Gluon main kernel takes the trailing masked slots as lengths in
# token order (``launch(in_order=True)``): one and two head blocks, a padded head block,
# small-head tiles, int64 and strided ids, K = 0 and K not a multiple of 64, more tiles
# than SMs
TRAIL_CASES = [
    Case(300, 64, 512, 900, 640, ids="tails"),
    Case(200, 128, 512, 700, 1152, ids="tails"),
    Case(150, 40, 512, 300, 130, ids="tails", sink=False),
    Case(64, 16, 512, 300, 200, ids="tails"),
    Case(140, 64, 512, 500, 300, ids="tails", idx_dtype=I64, noncontig=True),
    Case(50, 64, 512, 50, 0, ids="tails"),
]


@pytest.mark.parametrize("case", TRAIL_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_gluon_backward_skips_trailing_masked_slots(monkeypatch, case, deterministic):
    """Against the float64 oracle (grad_q poisoned with NaN before the call), and in the
    deterministic mode bitwise the gradients of the call without the option."""
    main = _gluon_bwd_or_skip(case.H)
    q, kv, idx, sink = make_case(case, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, case.D ** -0.5)
    do = torch.randn_like(out)

    def run(partial16):
        dq = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, case.D ** -0.5, main=main,
                                   deterministic=deterministic, grad_q=dq, partial16=partial16)

    rq, rkv, rs = oracle_bwd(do, None, q, kv, idx, sink, None, None)
    tol = TOL[case.dtype]
    # (at H = 128 the deterministic mode's fp32 rows too: head-block pairs)
    for partial16 in (None, False) if deterministic and case.H > 64 else (None,):
        monkeypatch.setattr(kbwd, "TRAILING_MASKED_SKIPPED", False)
        plain = run(partial16)
        monkeypatch.setattr(kbwd, "TRAILING_MASKED_SKIPPED", True)
        got = run(partial16)
        errs = dict(dq=relerr(got[0], rq), dkv=relerr(got[1], rkv))
        if sink is not None:
            errs["dsink"] = relerr(got[2], rs)
        assert errs["dq"] < tol["grad"] and errs["dkv"] < tol["grad"], (str(case), partial16, errs)
        assert errs.get("dsink", 0) < tol["sink"], (str(case), partial16, errs)
        if deterministic:
            assert all(torch.equal(a, b) for a, b in zip(plain, got)), (str(case), partial16)


@pytest.mark.parametrize("case", TRAIL_CASES, ids=str)
def test_gluon_forward_skips_trailing_masked_slots(monkeypatch, case):
    """``forward_gluon.TRAILING_MASKED_SKIPPED``: against the float64 oracle (out and lse
    poisoned with NaN), and bitwise the call without the option (a masked block adds exact
    zeros under a rescale of exactly 1)."""
    from dsv4_sparse_attn.kernels import forward_gluon

    reason = forward_gluon.rejects(Call.of(torch.empty(1, case.H, case.D, device=DEV, dtype=case.dtype)))
    if reason:
        pytest.skip(f"the Gluon forward does not run here: {reason}")
    q, kv, idx, sink = make_case(case, DEV)

    def run(on, ids=idx):
        monkeypatch.setattr(forward_gluon, "TRAILING_MASKED_SKIPPED", on)
        out = torch.full((case.T, case.H, case.D), float("nan"), dtype=case.dtype, device=DEV)
        lse = torch.full((case.T, case.H), float("nan"), dtype=torch.float32, device=DEV)
        return forward_gluon.sparse_mla_fwd(q, kv, ids, sink, case.D ** -0.5, out=out, lse=lse)

    plain, got = run(False), run(True)
    # the ids a slot apart (the lengths' launch reads them as given; the kernel, a copy)
    spread = run(True, torch.stack([idx, torch.zeros_like(idx)], 2).flatten(1)[:, ::2])
    assert all(torch.equal(a, b) for a, b in zip(spread, got)), str(case)
    ro, rl = oracle_fwd(q, kv, idx, sink, None, None)
    errs = dict(out=relerr(got[0], ro), lse=relerr(got[1], rl))
    tol = TOL[case.dtype]
    assert errs["out"] < tol["out"] and errs["lse"] < tol["lse"], (str(case), errs)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1]), str(case)


# More tiles than SMs with a remainder: the fast mode cuts the tiles past the last whole round
# into parts of a few slot blocks (backward_gluon._remainder_parts)
REMAINDER_CASES = [
    Case(300, 64, 512, 700, 300, ids="deepseek"),
    Case(140, 100, 512, 500, 200, ids="dup"),  # two head blocks, the second padded
    Case(270, 64, 512, 400, 640, ids="extreme"),
    Case(136, 64, 512, 300, 130, noncontig=True, sink=False),
]


@pytest.mark.parametrize("case", REMAINDER_CASES, ids=str)
def test_gluon_backward_remainder_parts_match_reference(case):
    """The fast mode with the remainder's tiles in parts: grad_q (poisoned with NaN before the
    call), grad_kv and grad_sink against the float64 oracle, on shapes where the launch does
    cut (on a GPU of fewer SMs some may not)."""
    from dsv4_sparse_attn.kernels import backward_gluon as G

    main = _gluon_bwd_or_skip(case.H)
    n_tiles = case.T * -(-case.H // G.BLOCK_H)
    grid = G.program_count(n_tiles, torch.device(DEV), False)
    n_full, n_parts = G._remainder_parts(n_tiles, grid, -(-case.K // G.BLOCK_K), True)
    if n_parts == 1:
        pytest.skip(f"{n_tiles} tiles on {grid} programs: no remainder to cut on this GPU")
    check_backward(case, DEV, deterministic=False, main=main)


@pytest.mark.parametrize("case", GLUON_BWD_CASES + [Case(64, 128, 512, 300, 256, ids="shared")], ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("split", [0, 1, 2], ids=["off", "single", "double"])
def test_gluon_backward_with_split_roles_matches_reference(monkeypatch, case, deterministic, split):
    """Each schedule of the blocks' roles, whatever the default of this Triton for the
    case (``backward_gluon._split``: ``SPLIT_ROLES``, ``SPLIT_ROLES_DET``,
    ``SPLIT_ROLES_DET_ONE_HB``): 0 the owner hands P and dS over, 1 and 2 the owner forms
    all its dKV rows while the other consumer computes the next block's S and dP, P and dS
    single- or double-buffered; against the float64 oracle, on the same cases as the
    default schedule. The deterministic mode is also bitwise equal across schedules (the
    same products into the same partial rows)."""
    main = _gluon_bwd_or_skip(case.H)
    if split == main._split(deterministic, None, -(-case.H // main.BLOCK_H), case.K):
        pytest.skip("this Triton's default schedule: test_gluon_backward_matches_reference runs it")
    if deterministic:
        _assert_det_bitwise(monkeypatch, main, case, {}, {name: split for name in _SPLIT_ATTRS})
    _force_split(monkeypatch, main, split)
    check_backward(case, DEV, deterministic=deterministic, main=main)


@pytest.mark.parametrize("case", [c for c in GLUON_BWD_CASES if c.H <= 64], ids=str)
def test_gluon_backward_without_the_pairs_code_matches_reference(monkeypatch, case):
    """The deterministic build of a launch without head-block pairs (one head block) with
    their code left out (``backward_gluon.PAIRS_CODE`` False: Triton 3.9's default) and kept
    (True: 3.6-3.8's): bitwise equal gradients, and against the float64 oracle."""
    main = _gluon_bwd_or_skip(case.H)
    _assert_det_bitwise(monkeypatch, main, case, {"PAIRS_CODE": True}, {"PAIRS_CODE": False})
    check_backward(case, DEV, deterministic=True, main=main)


# H <= 16 and <= 32: one block, many blocks, lengths, masked and duplicate ids
_SMALL_H_CASES = [c for c in GLUON_BWD_CASES if c.H <= 32] + [
    Case(300, 32, 512, 900, 640, ids="deepseek", lengths=True),
    Case(200, 32, 512, 300, 130, ids="dup"),
]


@pytest.mark.parametrize("case", _SMALL_H_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("head_pad,transposed", [(False, False), (True, False), (True, True)],
                         ids=["64", "head_pad", "transposed"])
def test_gluon_backward_small_head_tiles_match_reference(monkeypatch, case, deterministic, head_pad,
                                                         transposed):
    """A tile of H <= 32 heads: its dKV products over 16 or 32 heads (``HEAD_PAD``) or over all
    64 rows, and in the fast mode's split schedules every product transposed
    (``SMALL_H_TRANSPOSED``, heads as the wgmma's N): against the float64 oracle in each mode."""
    main = _gluon_bwd_or_skip(case.H)
    if (head_pad, transposed) == (main.HEAD_PAD, main.SMALL_H_TRANSPOSED) and case in GLUON_BWD_CASES:
        pytest.skip("the default: test_gluon_backward_matches_reference runs it")
    if transposed and deterministic:
        pytest.skip("transposed tiles are the fast mode's only")
    monkeypatch.setattr(main, "HEAD_PAD", head_pad)
    monkeypatch.setattr(main, "SMALL_H_TRANSPOSED", transposed)
    check_backward(case, DEV, deterministic=deterministic, main=main)


# tiles of 0, 1 and many blocks, more tiles than SMs, lengths (empty tiles among them),
# padding heads, a head-block pair in the deterministic mode
_EARLY_CASES = [
    Case(400, 64, 512, 50, 0),
    Case(2, 100, 512, 60, 1),
    Case(300, 128, 512, 700, 300, ids="deepseek"),
    Case(300, 128, 512, 700, 300, ids="deepseek", lengths=True),
    Case(200, 40, 512, 300, 130, ids="deepseek"),
    Case(64, 128, 512, 300, 256, ids="shared"),
]


@pytest.mark.parametrize("early", [2, 3])
@pytest.mark.parametrize("case", _EARLY_CASES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_gluon_backward_with_qd_early_release_matches_reference(monkeypatch, case, deterministic, early):
    """q and dO quarters released early (``backward_gluon.QD_EARLY``: TMA loads, split 2):
    against the float64 oracle (tiles of one and of many blocks, lengths with empty tiles in
    the deterministic case), and the deterministic mode bitwise equal to split 2 with the
    cp.async loads (the same products; only when the next tile's loads start differs)."""
    main = _gluon_bwd_or_skip(case.H)
    _force_split(monkeypatch, main, 2)
    if deterministic:  # against cp.async
        _assert_det_bitwise(monkeypatch, main, case, {"QD_TMA": False}, {"QD_TMA": True, "QD_EARLY": early})
    monkeypatch.setattr(main, "QD_TMA", True)
    monkeypatch.setattr(main, "QD_EARLY", early)
    check_backward(case, DEV, deterministic=deterministic, main=main)


@pytest.mark.parametrize("case", GLUON_BWD_CASES + [Case(64, 128, 512, 300, 256, ids="shared")], ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_gluon_backward_with_qd_tma_matches_reference(monkeypatch, case, deterministic):
    """q and dO by TMA (``backward_gluon.QD_TMA``; heads past H come in as zeros): against the
    float64 oracle on the default schedule's cases (H from 1 to 128, strided grad_out), and
    the deterministic mode bitwise equal to the cp.async loads (the same tiles in shared
    memory, the same products)."""
    main = _gluon_bwd_or_skip(case.H)
    assert main._tma_ok(make_case(case, DEV)[0])
    if deterministic:  # against cp.async
        _assert_det_bitwise(monkeypatch, main, case, {"QD_TMA": False}, {"QD_TMA": True})
    monkeypatch.setattr(main, "QD_TMA", True)
    check_backward(case, DEV, deterministic=deterministic, main=main)


@pytest.mark.parametrize("case", _EARLY_CASES, ids=str)
def test_gluon_backward_with_evict_last_reductions_matches_reference(monkeypatch, case):
    """The fast mode's reductions with the L2 evict-last policy (the default where the fp32
    accumulator is ``EVICT_LAST_MIN_L2`` times the L2; here at every size): against the
    float64 oracle (tiles of 0, 1 and many blocks, lengths, a head-block pair's heads)."""
    main = _gluon_bwd_or_skip(case.H)
    monkeypatch.setattr(main, "EVICT_LAST_MIN_L2", 0)
    assert main._evict_last(1, 512, torch.device(DEV), None)
    check_backward(case, DEV, deterministic=False, main=main)


def _record_l2_windows(monkeypatch) -> list:
    """The L2 window on at every size (``backward.L2_PERSIST_MIN_L2 = 0``); returns the list
    that each ``l2_policy.window`` entered appends (persist, set, rows) to."""
    import contextlib

    from dsv4_sparse_attn.kernels import l2_policy

    monkeypatch.setattr(kbwd, "L2_PERSIST_MIN_L2", 0)
    seen = []
    window = l2_policy.window

    @contextlib.contextmanager
    def recorded(t, persist=True):
        with window(t, persist) as on:
            seen.append((persist, on, None if t is None else t.shape[0]))
            yield on

    monkeypatch.setattr(l2_policy, "window", recorded)
    return seen


@pytest.mark.parametrize("case", [Case(300, 64, 512, 900, 640, ids="deepseek"),
                                  Case(200, 128, 512, 700, 300, ids="dup", lengths=True),
                                  Case(150, 40, 512, 500, 200, ids="extreme")], ids=str)
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_deterministic_backward_with_16_bit_partial_rows(case, gluon):
    """16-bit partial rows (the main kernel's fp16 stores with a scale a
    64-column segment, the fold's exact decoding) against the float64 oracle; H = 128 and 40
    take two head blocks a token, unpaired."""
    check_backward(case, DEV, deterministic=True, partial16=True, main=_main(gluon))


@pytest.mark.parametrize("H, lengths", [(64, False), (128, True), (16, False)])
def test_bf16_partial_rows_option(monkeypatch, H, lengths):
    """``backward.PARTIAL_16_BF16`` (a measurement option, off: the Gluon main kernel's rows
    as bf16, unscaled): the same bits run to run and for chunks of 70 tokens; grad_q and
    grad_sink those of the scaled fp16 rows (the rows do not enter them); grad_kv within
    bf16's rounding of them, and against the float64 oracle."""
    from helpers import relerr

    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)
    c = Case(300, H, 512, 900, 640, ids="deepseek", lengths=lengths)
    q, kv, idx, sink = make_case(c, DEV)
    length = make_lengths(c, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, topk_length=length)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def run(bf16, chunk=None):
        with monkeypatch.context() as m:
            m.setattr(kbwd, "PARTIAL_16_BF16", bf16)
            if chunk:
                m.setattr(kbwd, "PARTIAL_BYTES", chunk * -(-H // 64) * c.K * c.D * 4)
            return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5,
                                       main=_main(True), topk_length=length, partial16=True)

    a = run(True)
    for b in (run(True), run(True, chunk=70)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    f = run(False)
    assert torch.equal(a[0], f[0]) and torch.equal(a[2], f[2])
    assert 0 < relerr(a[1].float(), f[1].float()) < 6e-3
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, None)
    assert relerr(a[1], rkv) < 3e-2


@pytest.mark.parametrize("H, D, lengths", [(64, 512, False), (128, 512, True), (16, 512, False),
                                           (64, 576, True), (128, 576, False), (16, 576, False),
                                           (32, 576, True)])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_16_bit_partial_rows_give_the_same_bits_for_any_chunks(monkeypatch, gluon, H, D, lengths):
    """16-bit partial rows: the same bits run to run and for chunks of 300 and of 70 tokens;
    grad_q and grad_sink those of the fp32 rows (the rows do not enter them) and grad_kv
    within fp16's rounding of each row of them. D = 576: the 576/512 layout (its score-only
    columns two 32-column segments, one a Gluon consumer), also against the float64
    oracle; there H = 16 and 32 run the layout's 16- and 32-head tiles."""
    from helpers import relerr

    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)
    main = _main(gluon)
    c = Case(300, H, D, 900, 640, ids="deepseek", lengths=lengths)
    d_v = 512 if D == 576 else None
    q, kv, idx, sink = make_case(c, DEV)
    length = make_lengths(c, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, topk_length=length, d_v=d_v)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def run(partial16, chunk=None):
        with monkeypatch.context() as m:
            if chunk:
                m.setattr(kbwd, "PARTIAL_BYTES", chunk * -(-H // 64) * c.K * c.D * 4)
            return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main,
                                       topk_length=length, partial16=partial16)

    a = run(True)
    for b in (run(True), run(True, chunk=70)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    f = run(False)
    assert torch.equal(a[0], f[0]) and torch.equal(a[2], f[2])
    assert relerr(a[1].float(), f[1].float()) < 2e-3
    if d_v:
        rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, d_v)
        assert relerr(a[0], rq) < 3e-2 and relerr(a[1], rkv) < 3e-2 and relerr(a[2], rs) < 2e-2


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_fast_backward_under_the_l2_window_matches_reference(monkeypatch, gluon):
    """The fast mode's main launch with the accumulator's pool rows in the L2's persisting
    set-aside and the epilogue's window giving them back (the default where the
    accumulator is ``L2_PERSIST_MIN_L2`` times the L2; here at every size): both windows
    set on this GPU, then against the float64 oracle; the stream keeps no window after."""
    from dsv4_sparse_attn.kernels import l2_policy

    main = _main(gluon)
    set_ = _record_l2_windows(monkeypatch)
    case = Case(300, 64, 512, 900, 640, ids="deepseek")
    check_backward(case, DEV, deterministic=False, main=main)
    assert set_ == [(True, True, 600), (False, True, 600)], (set_, l2_policy.unavailable())
    assert l2_policy._get_window(torch.cuda.current_stream()).accessPolicyWindow.num_bytes == 0


def test_fast_backward_under_the_l2_window_in_a_cuda_graph(monkeypatch):
    """Where the fast mode takes the L2 window eagerly, a CUDA-graph capture of the same call
    sets none (``l2_policy.window`` yields False during a capture) and its replay gives the
    eager gradients, up to the order of the fast mode's fp32 adds."""
    from kernel_checks import TOL

    from dsv4_sparse_attn.kernels import l2_policy

    set_ = _record_l2_windows(monkeypatch)
    case = Case(300, 64, 512, 900, 640, ids="deepseek")
    q, kv, idx, sink = make_case(case, DEV)
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink)
    do = torch.randn_like(out)

    def bwd():
        return torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink)

    dsv4_sparse_attn.set_deterministic_backward(False)
    try:
        eager = bwd()
        assert [on for _, on, _ in set_] == [True, True], l2_policy.unavailable()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            bwd()  # (warm-up on the capture stream)
        torch.cuda.current_stream().wait_stream(s)
        set_.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = bwd()
        assert [on for _, on, _ in set_] == [False, False]
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, eager):
            assert relerr(a, b) < TOL[BF]["grad"] / 10
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)


@pytest.mark.parametrize("dq", [0, 1], ids=["dq_stores", "dq_tma_q"])
@pytest.mark.parametrize("split", [0, 1, 2], ids=["unsplit", "single", "double"])
@pytest.mark.parametrize("case", _EARLY_CASES + [Case(300, 64, 512, 900, 640, ids="deepseek", lengths=True),
                                                 Case(40, 16, 512, 300, 200, ids="dup", noncontig=True)],
                         ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_gluon_backward_with_each_dq_store_matches_reference(monkeypatch, case, deterministic, split, dq):
    """Each way of storing dQ that is not this Triton's default (``backward_gluon.DQ_TMA``: 0
    64 stores a thread, 1 staged in the tile's q quarters and stored by TMA), in every schedule:
    against the float64 oracle (tiles of 0, 1 and many blocks, lengths with empty tiles,
    padding heads, a head-block pair; poisoned grad_q, so an unwritten element fails), and
    the deterministic mode bitwise equal to the default
    (the same values)."""
    main = _gluon_bwd_or_skip(case.H)
    if dq == int(main.DQ_TMA):
        pytest.skip("this Triton's default: the other tests run it")
    _force_split(monkeypatch, main, split)
    if deterministic:
        _assert_det_bitwise(monkeypatch, main, case, {}, {"DQ_TMA": dq})
    monkeypatch.setattr(main, "DQ_TMA", dq)
    check_backward(case, DEV, deterministic=deterministic, main=main)


@pytest.mark.parametrize("split", [0, 2], ids=["unsplit", "double"])
def test_gluon_backward_timeline(monkeypatch, split):
    """``launch(trace=...)`` (measurement only; benchmarks/experiments/tile_timeline.py): the
    same dQ as without it (bitwise: summed in registers in a fixed order) and grad_kv to fp32
    rounding (atomics in any order), every tile of every program stamped, its events in order
    (the producer's: tile, q/dO issued, first and last gather; each consumer's: tile, q/dO
    landed, pieces done, end), the consumers seeing q/dO after the producer issued them."""
    main = _gluon_bwd_or_skip(128)
    monkeypatch.setattr(main, "SPLIT_ROLES", split)
    case = Case(300, 128, 512, 700, 300, ids="deepseek")
    q, kv, idx, sink = make_case(case, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, case.D ** -0.5)
    do = torch.randn_like(out)
    T, H = q.shape[:2]
    tr = torch.zeros(main.trace_shape(T, H, q.device, False), dtype=torch.int64, device=DEV)

    def run(trace=None):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, case.D ** -0.5, main=main,
                                   deterministic=False, trace=trace)

    plain, traced = run(), run(tr)
    assert torch.equal(plain[0], traced[0])
    torch.testing.assert_close(plain[1].float(), traced[1].float(), rtol=2e-2, atol=1e-3)
    ev = {name: i for i, name in enumerate(main.TRACE_EVENTS)}
    tr = tr.cpu()
    n_tiles, grid = T * 2, tr.shape[0]
    for p in range(grid):
        n = len(range(p, n_tiles, grid))
        e = tr[p, :n]
        assert (e != 0).all() and (tr[p, n:] == 0).all()
        for chain in (("p_tile", "p_qd", "p_first", "p_last"), ("c0_tile", "c0_qd", "c0_loop", "c0_end"),
                      ("c1_tile", "c1_qd", "c1_loop", "c1_end")):
            for a, b in zip(chain, chain[1:]):
                assert (e[:, ev[a]] <= e[:, ev[b]]).all(), (p, a, b)
        assert (e[:, ev["c0_qd"]] >= e[:, ev["p_qd"]]).all() and (e[:, ev["c1_qd"]] >= e[:, ev["p_qd"]]).all()
    with pytest.raises(ValueError, match="trace"):
        run(torch.zeros(1, 1, len(main.TRACE_EVENTS), dtype=torch.int64, device=DEV))


def test_backward_without_grad_lse():
    check_backward(Case(16, 64, 512, 200, 160, ids="deepseek"), DEV, with_dlse=False)


@pytest.mark.parametrize("rows16", [True, False], ids=["rows16-default", "rows32"])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_deterministic_backward_does_not_depend_on_chunking(monkeypatch, gluon, rows16):
    """A tiny partial-buffer budget forces one token per chunk: the deterministic mode
    folds every kv row's contributions in one fixed order whatever the chunks, so the
    gradients are bitwise the same as unchunked (heavily shared rows, duplicates); with the
    default partial rows (16 bits with the Gluon kernel) and with fp32 rows."""
    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)  # (the partial rows and their fold)
    monkeypatch.setattr(kbwd, "PARTIAL_16", rows16)
    main = _main(gluon)
    for c in (Case(12, 128, 512, 80, 70, ids="dup"),  # two head blocks: the Gluon path pairs fp32 rows
              Case(40, 64, 512, 30, 100, ids="shared")):
        q, kv, idx, sink = make_case(c, DEV)
        out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5)
        do, dl = torch.randn_like(out), torch.randn_like(lse)
        a = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main)
        with monkeypatch.context() as m:
            m.setattr(kbwd, "PARTIAL_BYTES", 1)
            b = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("lengths", [False, True], ids=["ids", "lengths"])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_deterministic_ids_inverted_beside(monkeypatch, gluon, lengths):
    """The id inversions on the second stream (``SORT_BESIDE``, the default: the first
    group's beside Delta, each next group's beside a fold) against inline: the same bits,
    with chunks of 20 tokens and groups of one and of three chunks (the last group short),
    on a stream of the caller's own; and the float64 oracle."""
    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)  # (the partial rows and their fold)
    assert kbwd.SORT_BESIDE
    main = _main(gluon)
    c = Case(150, 64, 512, 500, 200, ids="deepseek", lengths=lengths)
    q, kv, idx, sink = make_case(c, DEV)
    length = make_lengths(c, DEV) if lengths else None
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, topk_length=length)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def run(beside, group):
        with monkeypatch.context() as m:
            m.setattr(kbwd, "SORT_BESIDE", beside)
            m.setattr(kbwd, "PARTIAL_BYTES", 20 * c.K * c.D * 4)  # (tokens of 4 or 2 bytes a value)
            m.setattr(kbwd, "SORT_ENTRIES", group * 20 * 2 * c.K)
            user = torch.cuda.Stream()
            user.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(user):
                r = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main,
                                        topk_length=length)
            torch.cuda.current_stream().wait_stream(user)
            return r

    a = run(False, 1)
    for beside, group in ((True, 1), (True, 3), (False, 3)):
        b = run(beside, group)
        for x, y in zip(a, b):
            assert torch.equal(x, y), (beside, group)
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, None)
    assert relerr(a[0], rq) < 3e-2 and relerr(a[1], rkv) < 3e-2 and relerr(a[2], rs) < 2e-2


@pytest.mark.parametrize("case", [Case(300, 64, 512, 900, 640, ids="deepseek", lengths=True),
                                  Case(200, 128, 512, 700, 300, ids="deepseek", lengths=True),
                                  Case(150, 64, 576, 500, 200, ids="dup", lengths=True)], ids=str)
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_deterministic_backward_longest_first(monkeypatch, gluon, case):
    """With lengths and the chunks taking the tokens longest first (``backward.length_order``,
    forced here at any size): the same bits unchunked, in one-token chunks and in chunks of
    whole waves, and the float64 oracle (one head block with the split schedule, the
    head-block pair, the 576/512 layout; lengths past K and negative)."""
    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)  # (the partial rows and their fold)
    main = _main(gluon)
    monkeypatch.setattr(kbwd, "LENGTH_ORDER_MIN_BYTES", 0)
    d_v = 512 if case.D == 576 else None
    q, kv, idx, sink = make_case(case, DEV)
    length = make_lengths(case, DEV)
    assert not torch.equal(kbwd.length_order(length, case.K).cpu(), torch.arange(case.T, dtype=torch.int32))
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, case.D ** -0.5, topk_length=length, d_v=d_v)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def run(budget):
        with monkeypatch.context() as m:
            m.setattr(kbwd, "PARTIAL_BYTES", budget)
            return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, case.D ** -0.5, main=main,
                                       topk_length=length)

    a = run(kbwd.PARTIAL_BYTES)
    for budget in (1, 40 * case.K * case.D * 4):
        b = run(budget)
        for x, y in zip(a, b):
            assert torch.equal(x, y), budget
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, d_v)
    assert relerr(a[0], rq) < 3e-2 and relerr(a[1], rkv) < 3e-2 and relerr(a[2], rs) < 2e-2


@pytest.mark.parametrize("D, d_v", [(512, None), (576, 512)], ids=["d512", "v32"])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_deterministic_fold_tiles_give_the_same_bits(monkeypatch, gluon, D, d_v):
    """At N = 40,000, most rows untouched: the fold with kv rows side by side (the tiles
    ``backward.fold_tile`` gives long contexts, and a wider one) gives the bits of one row a
    program, skips the rows no token selects, and matches the float64 oracle. At 576/512
    the one-row tile folds whole 1024-column rows and the others 256-column blocks
    (``backward.fold_block_d``), the last of a row masked."""
    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)  # (the partial rows and their fold)
    main = _main(gluon)
    c = Case(48, 64, D, 40000, 160, ids="random")
    q, kv, idx, sink = make_case(c, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, d_v=d_v)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def run(tile):
        with monkeypatch.context() as m:
            m.setattr(kbwd, "fold_tile", lambda N, n_sm, n_part=1: tile)
            m.setattr(kbwd, "FOLD_RUNS", False)
            return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main)

    a = run((1, 8, 4))
    for tile in ((4, 4, 4), (8, 4, 8)):
        b = run(tile)
        for x, y in zip(a, b):
            assert torch.equal(x, y), tile
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, None, d_v)
    assert relerr(a[0], rq) < 3e-2 and relerr(a[1], rkv) < 3e-2 and relerr(a[2], rs) < 2e-2


@pytest.mark.parametrize("H, D, d_v, lengths", [(64, 512, None, False), (128, 512, None, True),
                                                (64, 576, 512, False), (100, 512, None, True)],
                         ids=["h64", "h128-lengths", "v32", "h100-lengths"])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_deterministic_fold_by_entry_runs_gives_the_same_bits(monkeypatch, gluon, H, D, d_v, lengths):
    """At N = 40,000 (most rows untouched, a few entries a pool row, the long contexts'
    case), over several chunks: the fold cut by entries (``backward.FOLD_RUNS``, the default
    beyond ``FOLD_RUNS_MIN_ROWS`` rows an SM) in the default configuration and two others
    gives the bits of the fold by kv rows, and the float64 oracle's gradients; with H = 128
    and 100 two head blocks a token (pairs, or two partial rows an entry), with lengths."""
    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)  # (the partial rows and their fold)
    main = _main(gluon)
    c = Case(300, H, D, 40000, 160, ids="random", lengths=lengths)
    q, kv, idx, sink = make_case(c, DEV)
    length = make_lengths(c, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, d_v=d_v, topk_length=length)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    monkeypatch.setattr(kbwd, "PARTIAL_BYTES", 100 * -(-H // 64) * c.K * c.D * 4)  # chunks of 100 or fewer

    def run(runs, config=None):
        with monkeypatch.context() as m:
            m.setattr(kbwd, "FOLD_RUNS", runs)
            if config is not None:
                m.setattr(kbwd, "FOLD_RUNS_CONFIG", config)
            return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main,
                                       topk_length=length)

    a = run(False)
    for config in (None, (8, 4, 8, True), (4, 4, 3, False)):
        b = run(True, config)
        for x, y in zip(a, b):
            assert torch.equal(x, y), config
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, d_v)
    assert relerr(a[0], rq) < 3e-2 and relerr(a[1], rkv) < 3e-2 and relerr(a[2], rs) < 2e-2


@pytest.mark.parametrize("case", [Case(132, 64, 512, 4000, 640, ids="random"),
                                  Case(120, 128, 512, 3000, 300, ids="random", lengths=True),
                                  Case(150, 16, 512, 3000, 200, ids="random"),
                                  Case(90, 64, 576, 3000, 200, ids="random")], ids=str)
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_exact_sums_backward_is_the_same_for_any_token_order(gluon, case):
    """The exact sums option of the deterministic mode (``exact=True``, one launch,
    kernels/exact_sums.py): three calls and two token orders give bitwise the same grad_kv
    (grad_q to its rounding), near the fold's, and all gradients match the float64 oracle.
    Rows of a few tens of slots: rows selected by hundreds of slots lose most of their bits
    to the loose bound (docs/performance/backward.md#exact-two-word-sums-measured-off), which is
    why the option is off."""
    if gluon and case.D == 576:
        pytest.skip("the Gluon backward's exact sums are at D = 512 only (576/512: the fold)")
    main = _gluon_bwd_or_skip(case.H) if gluon else backward_triton
    d_v = 512 if case.D == 576 else None
    q, kv, idx, sink = make_case(case, DEV)
    length = make_lengths(case, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, case.D ** -0.5, topk_length=length, d_v=d_v)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def run(perm, exact=True):
        pl = length[perm] if length is not None else None
        return kbwd.sparse_mla_bwd(do[perm], dl[perm], q[perm], kv, out[perm], lse[perm], idx[perm], sink,
                                   case.D ** -0.5, main=main, topk_length=pl, exact=exact)

    ident = torch.arange(case.T, device=DEV)
    a = run(ident)
    for perm in (ident, ident, torch.randperm(case.T, device=DEV)):
        b = run(perm)
        # (grad_q's bits follow the tiles' split into parts, which moves with the order)
        assert torch.equal(a[1], b[1]) and relerr(a[0][perm], b[0]) < 1e-6
    fold = run(ident, exact=False)
    assert relerr(a[1], fold[1]) < 2e-2
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, d_v)
    assert relerr(a[0], rq) < 3e-2 and relerr(a[1], rkv) < 3e-2 and relerr(a[2], rs) < 2e-2


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_backward_is_deterministic(gluon):
    """Two runs on the same inputs give bitwise-identical gradients (heavily shared rows)."""
    main = _main(gluon)
    c = Case(256, 128, 512, 300, 256, ids="shared")
    q, kv, idx, sink = make_case(c, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    a = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main)
    b = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("T, H", [(33000, 128), (4096, 64), (257, 5)])
def test_epilogue_sink_sum_takes_every_part(T, H):
    """The epilogue's grad_sink: the last of its many programs (T / 256 segments times H / 16
    head blocks: 1040 at T = 33000, H = 128) to take the ticket sums every program's part;
    a program that read a part before its store was visible would change the sum. Fifty
    launches, each on a fresh ticket and a fresh accumulator, beside grad_kv's conversion:
    bitwise the same every time, and the float64 formula's value. The ticket ends at the
    number of parts' programs."""
    g = torch.Generator(device=DEV).manual_seed(0)
    lse = torch.randn(T, H, device=DEV, generator=g)
    delta = torch.randn(T, H, device=DEV, generator=g)
    sink = torch.randn(H, device=DEV, generator=g)
    want = -(torch.exp(sink.double()[None] - lse.double()) * delta.double()).sum(0)
    first = None
    for _ in range(50):
        acc, counters = kbwd.zeroed_accumulator(3000, 512, 4, DEV)
        acc.normal_(generator=g)
        gkv, gs = kbwd.epilogue(acc, BF, True, sink, lse, delta, counters[:1])
        first = gs.clone() if first is None else first
        assert torch.equal(gs, first)
        assert counters[0].item() == -(-T // kbwd.SINK_SEG_T) * -(-H // 16)
    assert relerr(first.double(), want) < 1e-5  # (over the heads: a head's sum may cancel to near 0)


def _n_compiled(jit_fn) -> int:
    return sum(len(c[0]) for c in jit_fn.device_caches.values())


def test_no_recompile_when_T_K_N_change():
    """T, N and K are runtime values: three sequence lengths / top-ks compile each kernel once.
    (All three K leave a tile's last odd block past K, so the Gluon forward runs its DEAD
    build for each, ``forward_gluon.dead_odd_block``; K % 128 of 0 or above 64 takes the
    other one: two builds over every K, not one per K.)"""
    from dsv4_sparse_attn.kernels import backward_gluon, forward_gluon

    gluon = forward_gluon.rejects(Call.of(torch.empty(1, 64, 512, device=DEV, dtype=BF))) is None
    shapes = [(100, 64, 160), (257, 64, 129), (1031, 64, 47)]
    sizes_before = None
    for i, (T, H, K) in enumerate(shapes):
        c = Case(T, H, 512, T + 50, K, ids="deepseek")
        check_forward(c, DEV)
        if gluon:
            check_forward(c, DEV, fwd=forward_gluon.sparse_mla_fwd)
        check_backward(c, DEV)
        if gluon:
            check_backward(c, DEV, main=backward_gluon)
            check_backward(c, DEV, main=backward_gluon, deterministic=False)
        sizes = (_n_compiled(kfwd._sparse_mla_fwd_kernel), _n_compiled(backward_triton._bwd_main_kernel),
                 _n_compiled(kbwd._epilogue_kernel),
                 _n_compiled(kbwd._dkv_reduce_kernel), _n_compiled(kbwd._bwd_delta_kernel),
                 _n_compiled(forward_gluon._sparse_mla_fwd_gluon_kernel),
                 _n_compiled(backward_gluon._bwd_main_gluon_kernel))
        if sizes_before is not None:
            assert sizes == sizes_before, f"recompiled at T={T}, K={K}: {sizes_before} -> {sizes}"
        sizes_before = sizes


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_forward_int64_offsets(kernel):
    """T*H*D > 2**31 elements: offsets must be computed in int64."""
    from dsv4_sparse_attn.kernels import forward_gluon

    T, H, D = 33000, 128, 512  # 2.16e9 elements, 4.3 GB of bf16 q
    q = torch.randn(T, H, D, device=DEV, dtype=BF)
    fwd = kfwd.sparse_mla_fwd
    if kernel == "gluon":
        reason = forward_gluon.rejects(Call.of(q))
        if reason:
            pytest.skip(f"the Gluon forward does not run here: {reason}")
        fwd = forward_gluon.sparse_mla_fwd
    kv = torch.randn(64, D, device=DEV, dtype=BF)
    idx = torch.randint(0, 64, (T, 8), device=DEV, dtype=I32)
    out, lse = fwd(q, kv, idx, None, D ** -0.5)
    from helpers import oracle_fwd, relerr

    for t in (0, T // 2, T - 1):  # check the last tokens, past the 2**31 boundary
        ro, rl = oracle_fwd(q[t:t + 1], kv, idx[t:t + 1], None)
        assert relerr(out[t:t + 1], ro) < 2e-2
        assert relerr(lse[t:t + 1], rl) < 1e-3
    del q, out


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_backward_int64_offsets(kernel):
    """T*H*D > 2**31 elements in q, dO and grad_q: the backward's offsets are int64.

    Only the last tokens select kv rows (every other row is empty), so grad_kv and
    grad_sink are theirs alone and the float64 oracle runs on those tokens only.
    """
    from helpers import oracle_bwd, relerr
    from kernel_checks import TOL

    main = _main(kernel == "gluon")
    T, H, D, N, K, last = 33000, 128, 512, 64, 64, 3
    torch.manual_seed(0)
    q = torch.randn(T, H, D, device=DEV, dtype=BF)
    kv = torch.randn(N, D, device=DEV, dtype=BF)
    sink = torch.randn(H, device=DEV)
    idx = torch.full((T, K), -1, device=DEV, dtype=I32)
    idx[-last:] = torch.randint(0, N, (last, K), device=DEV, dtype=I32)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5)
    do = torch.randn_like(out)
    gq = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    gq, gkv, gs = kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5, main=main, grad_q=gq)
    rq, rkv, rs = oracle_bwd(do[-last:], None, q[-last:], kv, idx[-last:], sink)
    assert relerr(gq[-last:], rq) < TOL[BF]["grad"]
    assert relerr(gkv, rkv) < TOL[BF]["grad"]
    assert relerr(gs, rs) < TOL[BF]["sink"]
    assert not gq[:-last].any(), "empty rows must get zero grad_q"
    del q, out, do, gq


def test_ops_dispatch_to_kernel_and_fallback():
    """The CUDA op runs the kernel for bf16 and falls back (with a warning) for float32."""
    import warnings

    import dsv4_sparse_attn  # noqa: F401
    from kernel_checks import TOL
    from helpers import oracle_fwd, relerr

    from dsv4_sparse_attn.kernels import common

    common._warned.clear()  # the fallback warns once per process
    from dsv4_sparse_attn.kernels import dispatch

    c = Case(8, 64, 512, 100, 96)
    q, kv, idx, sink = make_case(c, DEV)
    out, lse = torch.ops.dsv4.sparse_mla(q, kv, idx, sink)
    ro, rl = oracle_fwd(q, kv, idx, sink)
    assert relerr(out, ro) < TOL[BF]["out"]
    assert not dispatch._broken, f"a Gluon kernel failed to build: {dispatch._broken}"
    q.requires_grad_(True)
    kv.requires_grad_(True)
    torch.ops.dsv4.sparse_mla(q, kv, idx, sink)[0].float().square().sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert not dispatch._broken, f"the Gluon backward failed to build: {dispatch._broken}"
    q, kv = q.detach(), kv.detach()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out32, _ = torch.ops.dsv4.sparse_mla(q.float(), kv.float(), idx, sink)
    assert any("reference" in str(x.message) for x in w)
    assert relerr(out32, ro) < 1e-5


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
def test_op_runs_the_gluon_kernels_on_hopper(deterministic):
    """On an H100/H200 the op takes the Gluon forward and backward (no silent fallback to
    Triton: the Triton 3.6-3.9 portability check), in both backward modes."""
    from dsv4_sparse_attn.kernels import dispatch

    _gluon_bwd_or_skip()
    q = torch.empty(1, 64, 512, device=DEV, dtype=BF)
    assert dispatch.choose("forward", Call.of(q))[0] == "gluon_sm90"
    assert dispatch.choose("backward", Call.of(q, deterministic))[0] == "gluon_sm90"
    c = Case(40, 64, 512, 300, 200, ids="deepseek")
    q, kv, idx, sink = make_case(c, DEV)
    dsv4 = __import__("dsv4_sparse_attn")
    dsv4.set_deterministic_backward(deterministic)
    try:
        q.requires_grad_(True)
        torch.ops.dsv4.sparse_mla(q, kv, idx, sink)[0].float().square().sum().backward()
    finally:
        dsv4.set_deterministic_backward(None)
    assert not dispatch._broken, dispatch._broken
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
@pytest.mark.parametrize("layout", ["lengths", "v32", "v32-lengths", "v32-many-tiles"])
def test_lengths_and_the_v32_layout_through_the_ops(layout, deterministic):
    """topk_length (values past K and negative included) and the 576/512 layout through the
    ops, against the float64 oracle: the Gluon kernels run the lengths at D = 512 on sm_90,
    the Gluon backward and forward the 576/512 layout, the Triton kernels the rest."""
    _check_lengths_and_v32(layout, deterministic)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
@pytest.mark.parametrize("layout", ["v32", "v32-lengths", "v32-many-tiles"])
def test_v32_layout_with_the_other_dq_store(monkeypatch, layout, deterministic):
    """The 576/512 layout's value columns of dQ stored the way that is not this Triton's
    default for the layout (``backward_gluon.DQ_TMA_ROPE``: staged in q's quarters and stored
    by TMA, or 64 stores a thread), the rope columns from the scratch rows either way."""
    main = _gluon_bwd_or_skip()
    monkeypatch.setattr(main, "DQ_TMA_ROPE", not main.DQ_TMA_ROPE)
    _check_lengths_and_v32(layout, deterministic)


def _check_lengths_and_v32(layout, deterministic):
    T, H, N, K = (300, 128, 700, 300) if layout.endswith("many-tiles") else (9, 64, 700, 640)
    D, d_v = (576, 512) if layout.startswith("v32") else (512, None)
    torch.manual_seed(0)
    q = torch.randn(T, H, D, device=DEV).to(BF)
    kv = torch.randn(N, D, device=DEV).to(BF)
    idx = deepseek_indices(T, K, n_pool=N - T, device=DEV).clamp(max=N - 1)
    length = None
    if layout.endswith("lengths"):
        length = torch.tensor([0, 1, 64, 65, 200, 639, 640, 900, -3], dtype=torch.int32, device=DEV)
        if layout == "lengths":  # a strided view (stride 2), as a slice of a wider tensor gives
            length = length.repeat_interleave(2)[::2]
    sink = torch.randn(H, device=DEV)
    do = torch.randn(T, H, d_v or D, device=DEV).to(BF)
    dlse = torch.randn(T, H, device=DEV)
    call = Call.of(q, deterministic, d_v=d_v or D, has_len=length is not None)
    from dsv4_sparse_attn.kernels import backward_gluon, forward_gluon

    want = ["gluon_sm90" if mod.rejects(call) is None else "triton"
            for mod in (forward_gluon, backward_gluon)]
    assert [dispatch.choose(direction, call)[0] for direction in ("forward", "backward")] == want
    dsv4_sparse_attn.set_deterministic_backward(deterministic)
    try:
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length, d_v)
        gq, gkv, gs = torch.ops.dsv4.sparse_mla_bwd(do, dlse, q, kv, out, lse, idx, sink, None, length,
                                                    d_v)
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)
    ro, rl = oracle_fwd(q, kv, idx, sink, None, length, d_v)
    rq, rkv, rs = oracle_bwd(do, dlse, q, kv, idx, sink, None, length, d_v)
    assert out.shape == (T, H, d_v or D) and gq.shape == q.shape and gkv.shape == kv.shape
    errs = dict(out=relerr(out, ro), lse=relerr(lse, rl), dq=relerr(gq, rq), dkv=relerr(gkv, rkv),
                dsink=relerr(gs, rs))
    assert errs["out"] < 2e-2 and errs["lse"] < 1e-3 and errs["dsink"] < 2e-2, errs
    assert errs["dq"] < 3e-2 and errs["dkv"] < 3e-2, errs


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (a call off the current one)")
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
def test_op_on_a_gpu_that_is_not_the_current_one(deterministic):
    """Tensors on cuda:1 while cuda:0 is current: the kernels must run on cuda:1 on its
    stream, ordered with the memsets and sorts the backward queues there (they ran on the
    current GPU before ``dispatch.on_device``). Against the oracle, and in the deterministic
    mode bitwise against the same call with cuda:1 current."""
    from kernel_checks import TOL

    c = Case(64, 64, 512, 300, 256, ids="shared")
    q, kv, idx, sink = make_case(c, "cuda:1")
    do = torch.randn(c.T, c.H, c.D, device="cuda:1").to(q.dtype)

    def call():
        qg, kvg, sg = (x.detach().requires_grad_() for x in (q, kv, sink))
        out, _ = torch.ops.dsv4.sparse_mla(qg, kvg, idx, sg)
        return (out,) + torch.autograd.grad(out, (qg, kvg, sg), do)

    dsv4_sparse_attn.set_deterministic_backward(deterministic)
    try:
        torch.cuda.set_device(0)
        got = call()
        with torch.cuda.device(1):
            want = call()
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)
    ro, _ = oracle_fwd(q, kv, idx, sink)
    rq, rkv, rs = oracle_bwd(do, None, q, kv, idx, sink)
    assert all(x.device == torch.device("cuda", 1) for x in got)
    assert relerr(got[0], ro) < TOL[BF]["out"]
    assert relerr(got[1], rq) < TOL[BF]["grad"] and relerr(got[2], rkv) < TOL[BF]["grad"]
    assert relerr(got[3], rs) < TOL[BF]["sink"]
    if deterministic:
        for x, y in zip(got, want):
            assert torch.equal(x, y)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fast"])
def test_op_takes_unaligned_rows_on_the_gluon_kernels(deterministic):
    """q, kv and dO 2 bytes off a 16-byte boundary, with rows 520 elements apart: the Gluon
    kernels get aligned copies (``common.aligned16``) instead of a launch that does not
    compile, which would have dropped them for the rest of the process."""
    from kernel_checks import TOL

    T, H, D, N, K = 8, 64, 512, 300, 256

    def unaligned(rows, width):
        flat = torch.randn(1 + rows * (width + 8), device=DEV).to(BF)
        return flat[1:].view(rows, width + 8)[:, :width]

    q, kv = unaligned(T, H * D).unflatten(1, (H, D)), unaligned(N, D)
    do = unaligned(T, H * D).unflatten(1, (H, D))
    idx = deepseek_indices(T, K, n_pool=N - T, device=DEV)
    sink = torch.randn(H, device=DEV)
    dsv4_sparse_attn.set_deterministic_backward(deterministic)
    try:
        qg, kvg, sg = (x.detach().requires_grad_() for x in (q, kv, sink))
        out, _ = torch.ops.dsv4.sparse_mla(qg, kvg, idx, sg)
        gq, gkv, gs = torch.autograd.grad(out, (qg, kvg, sg), do)
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)
    assert not dispatch._broken, f"a Gluon kernel was dropped: {dispatch._broken}"
    ro, _ = oracle_fwd(q, kv, idx, sink)
    rq, rkv, rs = oracle_bwd(do, None, q, kv, idx, sink)
    assert relerr(out, ro) < TOL[BF]["out"]
    assert relerr(gq, rq) < TOL[BF]["grad"] and relerr(gkv, rkv) < TOL[BF]["grad"]
    assert relerr(gs, rs) < TOL[BF]["sink"]


@pytest.mark.parametrize("H, K, ids, lengths", [(64, 640, "deepseek", False), (128, 640, "deepseek", True),
                                                (16, 1152, "dup", False), (64, 100, "random", True),
                                                (128, 160, "empty_rows", False)])
def test_fold_in_main_gives_the_shipped_bits(monkeypatch, H, K, ids, lengths):
    """``backward.FOLD_IN_MAIN`` (off; the Gluon main kernel folds the previous chunk's rows,
    stored at their ranks, and the last chunk is folded alone in that layout): every gradient
    bitwise that of the shipped deterministic call, for chunks of 300, 70 and 33 tokens and
    run to run, with each chunk folded after its main kernel instead (``"beside"``), and with
    the launches chained (``FOLD_CHAIN``: chunks of 70, 33 and 20 tokens, 5-15 launches, and
    sorts of two chunks); K
    past whole blocks (slots past K go to each part's spare row), lengths, duplicated ids,
    empty rows; grad_kv also against the float64 oracle."""
    monkeypatch.setattr(kbwd, "EXACT_SUMS", False)
    main = _main(True)
    c = Case(300, H, 512, 900, K, ids=ids, lengths=lengths)
    q, kv, idx, sink = make_case(c, DEV)
    length = make_lengths(c, DEV)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, c.D ** -0.5, topk_length=length)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    n_hb = -(-H // 64)

    def run(in_main, chunk=None, chain=False):
        with monkeypatch.context() as m:
            m.setattr(kbwd, "FOLD_IN_MAIN", in_main)
            m.setattr(kbwd, "FOLD_CHAIN", bool(chain))
            if chain == "groups":  # (sorts of two chunks: a group's first launch is not started early)
                m.setattr(kbwd, "SORT_ENTRIES", 2 * chunk * K)
            if chunk:  # (the design halves the budget, chained thirds it: chunks of ``chunk``)
                bufs = (3 if chain else 2) if in_main else 1
                per_chunk = chunk * n_hb * K * c.D * 4 * bufs  # (fp32 bytes)
                m.setattr(kbwd, "PARTIAL_BYTES", -(-per_chunk * 129 // 256))
            return kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, c.D ** -0.5, main=main,
                                       topk_length=length, partial16=True)

    ref = run(False)
    arms = ((True, None, False), (True, 70, False), (True, 33, False), ("beside", 70, False),
            (True, 70, True), (True, 33, True), (True, 20, True), (True, 20, "groups"))
    for in_main, chunk, chain in arms:
        got = run(in_main, chunk, chain)
        for name, a, b in zip(("grad_q", "grad_kv", "grad_sink"), ref, got):
            diff = (a.float() - b.float()).abs().max().item()
            assert torch.equal(a, b), (in_main, chunk, chain, name, diff)
    assert all(torch.equal(a, b) for a, b in zip(run(True, 70), run(False, 33)))
    for _ in range(3):  # (the chained launches' counters, run to run)
        assert all(torch.equal(a, b) for a, b in zip(run(True, 20, True), ref))
    rq, rkv, rs = oracle_bwd(do, dl, q, kv, idx, sink, None, length, None)
    assert relerr(ref[1], rkv) < 2e-2
