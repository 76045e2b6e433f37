"""How precise an exact (integer) dKV accumulation would be, on the CPU, in float64: every
(token, slot) piece of grad_kv formed as the backward forms it (rounded to fp32, as the
kernel's wgmma accumulators hold it), then summed per kv row four ways: in float64 (the
oracle), in fp32 in a random order (what the fast mode's reductions do, one random order
a run), and in fixed point on a per-row grid ``2^(ceil(log2 U_r) - B)`` with B = 62 (one
``red.add.u64`` a value) or B = 30 (one ``red.add.s32``), ``U_r`` the cheap bound of
docs/performance/backward.md#exact-integer-sums-measured: ``n_r * max C_t`` over the row's
entries, ``C_t = 2 H (max|dO_t| + scale max|q_t| (max||dO_t|| max||v|| + max|Delta_t|))``
(the 2: rounding slack), with |P| <= 1. And exact fp32 sums: each piece rounded to a
per-row grid ``2^(ceil(log2 U_r) - 22)`` (then fp32 adds are exact, in any order) from two
tighter bounds, the slot's attention mass (``mass``) or S and dP (``tight``; ``tight64``: a
bound and a grid a 64-column piece of the row), in one fp32
word (``f32grid``) or two (``f32grid2``: the residual on a finer grid), or in one s32 word on
that bound's grid ``2^(ceil(log2 U_r) - 30)`` (``mass_s32``, ``tight_s32``); and the deterministic
mode's partial rows in 16 bits (``bf16_rows``, ``fp16_rows_e64``), against the float64
sum rounded to bf16 (``bf16_of_exact``): docs/performance/backward.md, "Exact fp32 sums on a
per-row grid".

    PYTHONPATH=src:benchmarks/experiments python benchmarks/experiments/fixed_point_precision.py [T H K]

Prints, per method, ||sum - oracle|| / ||oracle|| over all rows and the largest
|error| / sum|pieces| of any element, and how loose the bound is (U_r against the row's
largest sum of magnitudes).
"""
import json
import sys

import torch

import dsv4_sparse_attn  # noqa: F401
from side_by_side import inputs


def pieces(q, kv, idx, sink, do, out, lse, scale):
    """[T, K, D] float64 pieces and the [T, K] ids (-1 where masked)."""
    q, kv, do, out = q.double(), kv.double(), do.double(), out.double()
    N = kv.shape[0]
    valid = (idx >= 0) & (idx < N)
    rows = kv[idx.clamp(0, N - 1).long()] * valid[..., None]
    s = torch.einsum("thd,tkd->thk", q, rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.exp(s - lse.double()[..., None])
    delta = (out * do).sum(-1)
    dp = torch.einsum("thd,tkd->thk", do, rows)
    ds = p * (dp - delta[..., None])
    v = scale * torch.einsum("thk,thd->tkd", ds, q) + torch.einsum("thk,thd->tkd", p, do)
    v = v * valid[..., None]
    bound_t = 2 * q.shape[1] * (do.abs().amax((1, 2)) + scale * q.abs().amax((1, 2)) * (
        do.norm(dim=-1).amax(1) * kv.norm(dim=-1).max() + delta.abs().amax(1)))
    # The mass bound: |piece_d| <= sum_h P_h (|dO_hd| + scale |dP_h - Delta_h| |q_hd|)
    # <= m_tk (A_t + B_t ||v_r||), m_tk = sum_h P_thk (the slot's attention mass, which a
    # pass over S gives), A_t = max_h (max|dO_th| + scale |Delta_th| max|q_th|),
    # B_t = max_h scale ||dO_th|| max|q_th|.
    mass = p.sum(1) * valid
    qmax = q.abs().amax(-1)
    a_t = (do.abs().amax(-1) + scale * delta.abs() * qmax).amax(1)
    b_t = (scale * do.norm(dim=-1) * qmax).amax(1)
    # The tight form (a pass over S and dP): w_tk = sum_h P_thk (max|dO_th| + scale
    # |dP_thk - Delta_th| max|q_th|), the bound of every column of the piece.
    dsm = (dp - delta[..., None]).abs()
    tight = (p * (do.abs().amax(-1)[..., None] + scale * dsm * qmax[..., None])).sum(1)
    # The same with the maxima over each 64-column piece (one bound a piece: [T, K, D / 64])
    T, H, D = q.shape
    do_p = do.abs().reshape(T, H, D // 64, 64).amax(-1)
    q_p = q.abs().reshape(T, H, D // 64, 64).amax(-1)
    tight64 = torch.einsum("thk,thp->tkp", p, do_p) + scale * torch.einsum("thk,thp->tkp", p * dsm, q_p)
    return v, torch.where(valid, idx.long(), -1), bound_t, (mass, a_t, b_t, tight * valid,
                                                            tight64 * valid[..., None])


def main():
    T, H, K = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (512, 16, 160)
    D = 512
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D, dev="cpu")
    N = kv.shape[0]
    v, ids, bound_t, (mass, a_t, b_t, tight, tight64) = pieces(q, kv, idx, sink, do, out, lse, D ** -0.5)
    v32 = v.float().double()  # the kernel's fp32 piece
    flat_ids = ids.reshape(-1)
    keep = flat_ids >= 0
    rows, vals = flat_ids[keep], v32.reshape(-1, D)[keep]
    exact = torch.zeros(N, D, dtype=torch.float64).index_add_(0, rows, vals)
    mag = torch.zeros(N, D, dtype=torch.float64).index_add_(0, rows, vals.abs())
    ones = torch.ones_like(rows, dtype=torch.float64)
    n_r = torch.zeros(N, dtype=torch.float64).index_add_(0, rows, ones)
    c = bound_t[:, None].expand(T, K).reshape(-1)[keep]
    m_r = torch.zeros(N, dtype=torch.float64).scatter_reduce_(0, rows, c, "amax", include_self=True)
    u_r = n_r * m_r
    used = n_r > 0
    assert bool((mag[used] <= u_r[used, None]).all()), "the bound does not hold"
    looseness = (u_r[used] / mag[used].amax(1).clamp_min(1e-300)).log2()
    res = dict(T=T, H=H, K=K, rows_used=int(used.sum()), entries_max=int(n_r.max()),
               bound_looseness_log2_median=round(looseness.median().item(), 1),
               bound_looseness_log2_max=round(looseness.max().item(), 1))

    def report(name, got):
        err = (got - exact)[used]
        res[name + "_rel_fro"] = float(f"{(err.norm() / exact[used].norm()).item():.3g}")
        worst = (err.abs() / mag[used].clamp_min(1e-300)).max().item()
        res[name + "_max_err_over_mag"] = float(f"{worst:.3g}")

    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(rows.numel(), generator=g)
    fp32 = torch.zeros(N, D, dtype=torch.float32).index_add_(0, rows[perm], vals[perm].float())
    report("fp32_random_order", fp32.double())
    for B, name in ((62, "u64"), (30, "s32")):
        e = torch.ceil(torch.log2(u_r.clamp_min(1e-300)))
        grid = torch.exp2(e - B)  # per row; every entry's value over the grid is below 2^B
        q_int = torch.round(vals / grid[rows, None]).to(torch.int64)
        # int64 adds wrap like the L2's: any order gives the same bits (one order here)
        acc = torch.zeros(N, D, dtype=torch.int64).index_add_(0, rows, q_int)
        if B == 30:  # one 32-bit word: the final sum must be in range (the bound says it is)
            assert bool((acc.abs() < 2**31).all())
        report(name, acc.double() * grid[:, None])
    # fp32 on a per-row grid from the mass bound: every piece rounded to a multiple of
    # g_r = 2^(ceil(log2 U_r) - 22), U_r = sum over the row's entries of
    # 2 m_tk (A_t + B_t ||v_r||) (2: slack for a mass summed from bf16 S), so every partial
    # sum of rounded pieces stays within 2^24 g_r: fp32 adds are then exact, and any order
    # (the fast mode's 16-byte reductions) gives the same bits.
    vnorm = kv.double().norm(dim=-1)
    # (w: a slot's bound, [T, K], or one a 64-column piece, [T, K, D / 64] (``tight64``: the
    # two-launch design of docs/performance/backward.md#the-grid-rounding-in-the-fast-kernel-measured
    # could sum it as it sums the row's); u and the grids below are per element, [N, D])
    for name, w in (("mass", 2 * mass * (a_t[:, None] + b_t[:, None] * vnorm[ids.clamp_min(0)])),
                    ("tight", 2 * tight), ("tight64", 2 * tight64)):
        w = w.reshape(T * K, -1)[keep]
        u = torch.zeros(N, w.shape[1], dtype=torch.float64).index_add_(0, rows, w)
        u = u.repeat_interleave(D // w.shape[1], dim=1)
        assert bool((mag[used] <= u[used]).all()), f"the {name} bound does not hold"
        loose_m = (u[used].amax(1) / mag[used].amax(1).clamp_min(1e-300)).log2()
        res[name + "_bound_looseness_log2_median"] = round(loose_m.median().item(), 1)
        res[name + "_bound_looseness_log2_max"] = round(loose_m.max().item(), 1)
        grid = torch.exp2(torch.ceil(torch.log2(u.clamp_min(1e-300))) - 22)
        rounded = (torch.round(vals / grid[rows]) * grid[rows]).float()
        assert bool((rounded.double() == torch.round(vals / grid[rows]) * grid[rows]).all())
        one = torch.zeros(N, D, dtype=torch.float32).index_add_(0, rows, rounded)
        two = torch.zeros(N, D, dtype=torch.float32).index_add_(0, rows[perm], rounded[perm])
        res[name + "_f32grid_orders_bitwise_equal"] = bool(torch.equal(one, two))
        report(name + "_f32grid", one.double())
        # two fp32 words a value: the residual of the rounding (exact in fp32) on a finer
        # grid from its own bound, n_r g_r / 2 (with the same factor 2 of slack)
        resid = (vals - rounded.double()).float()
        g_lo = torch.exp2(torch.ceil(torch.log2((n_r[:, None] * grid).clamp_min(1e-300))) - 22)
        lo = (torch.round(resid.double() / g_lo[rows]) * g_lo[rows]).float()
        lo_sum = torch.zeros(N, D, dtype=torch.float32).index_add_(0, rows[perm], lo[perm])
        lo_one = torch.zeros(N, D, dtype=torch.float32).index_add_(0, rows, lo)
        res[name + "_f32grid2_orders_bitwise_equal"] = bool(torch.equal(lo_sum, lo_one))
        report(name + "_f32grid2", one.double() + lo_one.double())
        # one s32 word a value on this bound's grid: 2^(ceil(log2 U_r) - 30), every partial
        # sum within 2^31 (wrapping adds: any order, the same bits)
        g32 = torch.exp2(torch.ceil(torch.log2(u.clamp_min(1e-300))) - 30)
        i32 = torch.round(vals / g32[rows]).to(torch.int64)
        acc32 = torch.zeros(N, D, dtype=torch.int64).index_add_(0, rows, i32)
        assert bool((acc32.abs() < 2**31).all())
        report(name + "_s32", acc32.double() * g32)
    # 16-bit partial rows (the deterministic mode's per-(token, slot) rows at half the bytes),
    # summed in fp32 in a fixed order as the fold sums them: each row rounded to bf16
    # (``bf16_rows``), or to fp16 after scaling each 64-column segment by a power of two that
    # puts its largest |value| in [2^14, 2^15) (``fp16_rows_e64``: the exponent, one byte a
    # segment, stored beside it; a row's 64 columns are one quad of a wgmma accumulator, so its
    # maximum is two shuffles), then scaled back exactly.
    bf16_rows = torch.zeros(N, D, dtype=torch.float32).index_add_(0, rows, vals.bfloat16().float())
    report("bf16_rows", bf16_rows.double())
    seg = vals.reshape(-1, D // 64, 64)
    e = torch.floor(torch.log2(seg.abs().amax(-1, keepdim=True).clamp_min(1e-300)))
    half = (seg * torch.exp2(14 - e)).half()
    assert bool(torch.isfinite(half).all())
    back = (half.double() * torch.exp2(e - 14)).reshape(-1, D).float()
    report("fp16_rows_e64", torch.zeros(N, D, dtype=torch.float32).index_add_(0, rows, back).double())
    # what the output dtype costs anyway: the float64 sum rounded to bf16
    report("bf16_of_exact", exact.bfloat16().double())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
