"""The second launch of the two-launch deterministic design, timed alone (a Triton
prototype; docs/performance/backward.md#exact-two-word-sums-measured-off and the grid
rounding's section): dKV = P^T dO + dS^T q from bf16 P and dS [T, H, K] stored by a first
launch, per (token, 64-slot block), each value rounded to its row's grid (one fp32 word,
x + C - C) and added with fp32 atomics; no kv gather, no S. Next to it: the same without
the rounding (``plain``), with the atomics predicated off (``no_adds``: the products and the
reads of P, dS, q and dO alone), and the fast backward as shipped, A, B, A, B. Timing only:
P and dS are random (the first launch is not built), the grids one constant.
SHAPES="T,H,K;...".

    PYTHONPATH=src python benchmarks/experiments/dkv_from_pds_bench.py

Prediction: the atomics as in the fast mode (its reductions' share, 0.55 ms at H64 K640
on an H100) but scalar fp32 ones from Triton (no 16-byte lines) and P / dS read once
(0.67 GB at H64 K640: 0.25 ms): 0.8-1.4 ms at H64 K640, T = 4096, against the fast
backward's 2.34; with the first launch at about the fast mode's time without reductions
(1.78 ms), the design at 1.1-1.4x the fast mode's time.
Measured (H100 SXM, Triton 3.6.0): 3.13 / 8.86 / 3.56 ms at H64 K640 / H128 K1152 /
H16 K1152 (1.35x / 1.19x / 1.03x the whole fast backward; without the adds 1.94 / 7.25 /
0.94): docs/performance/backward.md#the-two-launch-designs-second-launch-alone-probed.
"""
import json

import torch
import triton
import triton.language as tl

import dsv4_sparse_attn  # noqa: F401
from side_by_side import best_of_ab, env_shapes, gluon_backward, inputs


@triton.jit
def _dkv_from_pds(P, DS, Q, DO, IDX, ACC, H, K, N, C, D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                  BD: tl.constexpr, MODE: tl.constexpr):
    """Program (t, slot block): acc[idx[t, k]] += sum_h P[t,h,k] dO[t,h] + dS[t,h,k] q[t,h]
    (MODE 0: each value rounded to the grid of C first; 1: unrounded; 2: no adds)."""
    t = tl.program_id(0).to(tl.int64)
    k0 = tl.program_id(1) * BK
    offs_h = tl.arange(0, BH)
    offs_k = k0 + tl.arange(0, BK)
    k_ok = offs_k < K
    ids = tl.load(IDX + t * K + offs_k, mask=k_ok, other=-1)
    ok = k_ok & (ids >= 0) & (ids < N)
    rows = tl.where(ok, ids, 0).to(tl.int64)
    hm = offs_h[:, None] < H
    pk = (t * H + offs_h[:, None]) * K + offs_k[None, :]
    p = tl.load(P + pk, mask=hm & k_ok[None, :], other=0.0)  # [BH, BK]
    ds = tl.load(DS + pk, mask=hm & k_ok[None, :], other=0.0)
    for d0 in tl.static_range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        qd = (t * H + offs_h[:, None]) * D + offs_d[None, :]
        do = tl.load(DO + qd, mask=hm, other=0.0)  # [BH, BD]
        q = tl.load(Q + qd, mask=hm, other=0.0)
        x = tl.dot(tl.trans(p), do)
        x = tl.dot(tl.trans(ds), q, x)  # [BK, BD]
        if MODE == 0:
            x = (x + C) - C
        if MODE < 2:
            tl.atomic_add(ACC + rows[:, None] * D + offs_d[None, :], x, mask=ok[:, None], sem="relaxed")
        else:
            tl.store(ACC + rows[:, None] * D + offs_d[None, :], x, mask=ok[:, None] & (N < 0))


def run_pds(p, ds, q, do, idx, acc, mode, bd=128):
    T, H, K = p.shape
    N, D = acc.shape
    _dkv_from_pds[(T, triton.cdiv(K, 64))](
        p, ds, q, do, idx, acc, H, K, N, 24.0, D=D, BH=max(16, H), BK=64, BD=bd, MODE=mode, num_warps=4)


D = 512
for T, H, K in env_shapes([(4096, 64, 640), (4096, 128, 1152), (4096, 16, 1152)]):
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    run = gluon_backward(q, kv, idx, sink, do, out, lse, D ** -0.5)
    g = torch.Generator(device="cuda").manual_seed(0)
    p = (torch.rand(T, H, K, device="cuda", generator=g) / K).bfloat16()
    ds = (torch.randn(T, H, K, device="cuda", generator=g) / K).bfloat16()
    acc = torch.zeros(kv.shape[0], D, device="cuda")
    r = dict(T=T, H=H, K=K, gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    fns = {"fast": lambda: run(False), "grid": lambda: run_pds(p, ds, q, do, idx, acc, 0),
           "plain": lambda: run_pds(p, ds, q, do, idx, acc, 1),
           "no_adds": lambda: run_pds(p, ds, q, do, idx, acc, 2),
           "grid_bd256": lambda: run_pds(p, ds, q, do, idx, acc, 0, 256)}
    for name, ms in best_of_ab(fns).items():
        r[f"{name}_ms"] = round(ms, 4)
    r["grid_over_fast"] = round(r["grid_ms"] / r["fast_ms"], 3)
    print(json.dumps(r), flush=True)
    q = kv = idx = do = out = lse = run = p = ds = acc = fns = None
    torch.cuda.empty_cache()
