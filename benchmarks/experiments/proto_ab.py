"""Two Gluon-backward changes checked and timed in one process (H200, side-by-side ids):

1. The deterministic mode's partial rows in fake column order with 16-byte stores
   (``det_v4=True``) against natural order with 8-byte stores (``det_v4=False``): the
   gradients must be bitwise equal (the same sums in the same order), then the time.
   (The switch is in the kernels of b0ac5a0, branch proto/ab; on later kernels, which have
   only the 16-byte path, both columns time it.)
2. The 576/512 layout on the Gluon backward (``ROPE = 64``): gradients against the float64
   oracle on a small case with masked ids and lengths, fast against deterministic on the
   timed shapes, and TFLOPS (2*T*H*K*(3*D + 2*d_v)) against the D = 512 kernel's.

    PYTHONPATH=src:tests python benchmarks/experiments/proto_ab.py > ab.jsonl
"""
import inspect
import json
import os
import time

import torch
import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon, backward_triton

import side_by_side  # (this directory)
from side_by_side import relerr

# PROTO_AB_DRY=1: tiny shapes on the CPU through the Triton kernel (interpreter), to check
# the script itself before a GPU run
DRY = os.environ.get("PROTO_AB_DRY") == "1"
dev = "cpu" if DRY else "cuda"
main = backward_triton if DRY else backward_gluon
t0 = time.time()


def bench(fn):
    if DRY:
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median")


def emit(**r):
    r["t_s"] = round(time.time() - t0, 1)
    print(json.dumps(r), flush=True)


def inputs(T, H, K, D, d_v, seed):
    return side_by_side.inputs(T, H, K, D, d_v, seed, dev)


def bwd(x, det, **opts):
    q, kv, idx, sink, do, out, lse = x
    if DRY or "det_v4" not in inspect.signature(main.launch).parameters:
        opts.pop("det_v4", None)
    return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, q.shape[-1] ** -0.5,
                               main=main, deterministic=det, **opts)


# 1. deterministic partial rows: 16-byte stores in fake order against 8-byte natural order
ms512 = {}
SHAPES = [(4096, 64, 640), (4096, 128, 1152), (4096, 64, 2048)] if os.environ.get("PROTO_AB_SHORT") else [
    (4096, 64, 640), (4096, 128, 1152), (4096, 16, 1152), (4096, 64, 2048), (32768, 64, 640)]
V32_SHAPES = [(4096, 64, 640), (4096, 128, 1152), (4096, 64, 2048)]
if DRY:
    SHAPES, V32_SHAPES = [(8, 4, 160)], [(8, 4, 160)]
for T, H, K in SHAPES:
    x = inputs(T, H, K, 512, 512, T + H + K)
    a, b = bwd(x, True, det_v4=False), bwd(x, True, det_v4=True)
    same = all(torch.equal(u, v) for u, v in zip(a, b))
    fl = 10 * T * H * K * 512
    r = dict(part="det_v4", T=T, H=H, K=K, bitwise_equal=same)
    r["plain_ms"] = bench(lambda: bwd(x, True, det_v4=False))
    r["v4_ms"] = bench(lambda: bwd(x, True, det_v4=True))
    r["fast_ms"] = bench(lambda: bwd(x, False))
    for k in ("plain", "v4", "fast"):
        r[k + "_tflops"] = round(fl / r[k + "_ms"] * 1e-9, 1)
    r["v4_over_plain_time"] = round(r["v4_ms"] / r["plain_ms"], 3)
    ms512[(T, H, K)] = (r["v4_ms"], r["fast_ms"])
    emit(**r)

# 2. the 576/512 layout on the Gluon backward: small case against the oracle ...
from kernel_checks import oracle_bwd  # noqa: E402

for det in (True, False):
    for with_len in (False, True):
        torch.manual_seed(1)
        T, H, N, K = (5, 3, 40, 20) if DRY else (300, 40, 700, 300)
        q = torch.randn(T, H, 576, device=dev).bfloat16()
        kv = torch.randn(N, 576, device=dev).bfloat16()
        idx = torch.randint(-2, N + 2, (T, K), device=dev).int()
        idx[:, : K // 4] = idx[:, :1]  # duplicates
        length = torch.randint(-2, K + 3, (T,), device=dev).int() if with_len else None
        sink = torch.randn(H, device=dev)
        do = torch.randn(T, H, 512, device=dev).bfloat16()
        dlse = torch.randn(T, H, device=dev)
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length, 512)
        dq = torch.full_like(q, float("nan"))
        gq, gkv, gs = kbwd.sparse_mla_bwd(do, dlse, q, kv, out, lse, idx, sink, 576 ** -0.5,
                                          main=main, deterministic=det, grad_q=dq,
                                          topk_length=length)
        rq, rkv, rs = oracle_bwd(do, dlse, q, kv, idx, sink, None, length, 512)
        emit(part="v32_oracle", det=det, lengths=with_len, dq=relerr(gq, rq), dkv=relerr(gkv, rkv),
             dsink=relerr(gs, rs), finite=bool(torch.isfinite(gq).all() and torch.isfinite(gkv).all()))

# ... and timed next to D = 512
for T, H, K in V32_SHAPES:
    x = inputs(T, H, K, 576, 512, T + H + K + 1)
    d, f = bwd(x, True), bwd(x, False)
    r = dict(part="v32_time", T=T, H=H, K=K, fast_vs_det_dq=relerr(f[0], d[0]),
             fast_vs_det_dkv=relerr(f[1], d[1]))
    r["det_ms"] = bench(lambda: bwd(x, True))
    r["fast_ms"] = bench(lambda: bwd(x, False))
    fl = 2 * T * H * K * (3 * 576 + 2 * 512)
    fl512 = 10 * T * H * K * 512
    for k, i in (("det", 0), ("fast", 1)):
        r[k + "_tflops"] = round(fl / r[k + "_ms"] * 1e-9, 1)
        r[k + "_tflops_d512"] = round(fl512 / ms512[(T, H, K)][i] * 1e-9, 1)
        r[k + "_ratio"] = round(r[k + "_tflops"] / max(r[k + "_tflops_d512"], 1e-9), 3)
    emit(**r)
