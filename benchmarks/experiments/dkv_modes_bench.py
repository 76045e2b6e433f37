"""How the backward's dKV accumulation should be done: the Gluon main kernel with each
accumulation mode, timed next to cuDNN's backward, plus a reduction-throughput probe.

    PYTHONPATH=src:benchmarks/experiments:/tmp/cudnn_site \
        python benchmarks/experiments/dkv_modes_bench.py PEER_DIR

Modes (bwd_dkv_modes.py): 1 fp32 atomics as shipped (8-byte reds), 2 16-byte fp32 reds in
fake column order, 3 int64 fixed-point reds, 4 mode 2 with the reductions predicated off.
"""
import json
import math
import os

import torch
import triton
import triton.language as tl

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import bench, inputs, relerr  # (this directory)
from side_by_side import cudnn_peer as load_peer
import bwd_dkv_modes as X

dev = "cuda"
D = 512
OUT = os.environ.get("OUT", "/tmp")
cudnn_peer = load_peer()


def unfake(acc):
    """[R, 512] fp32 in fake column order -> natural order."""
    c = torch.arange(512, device=acc.device)
    fake = (c & ~15) | (((c & 7) >> 1) << 2) | (((c >> 3) & 1) << 1) | (c & 1)
    return acc[:, fake]


rows = []
for T, H, K in [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 32, 1152),
                (32768, 64, 640)]:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    N, scale = kv.shape[0], D ** -0.5
    fl = 10 * T * H * K * D
    r = dict(T=T, H=H, K=K)
    ref = kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                              deterministic=True)
    for det in (True, False):
        f = lambda: kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                        deterministic=det)
        r["shipped_" + ("det" if det else "atomic") + "_ms"] = bench(f)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    n_hb = triton.cdiv(H, 64)
    flags = torch.zeros(1 + 2 * T * n_hb, dtype=torch.int32, device=dev)
    dq = torch.empty_like(q)
    amax = ref[1].float().abs().max().item()
    sexp = 60 - math.ceil(math.log2(max(amax, 1e-30) * 4))
    for mode in (1, 2, 3, 4):
        rows_n = N + 1
        acc = torch.zeros((rows_n, D * (2 if mode == 3 else 1)), dtype=torch.float32, device=dev)

        def run(acc=acc, mode=mode):
            acc.zero_()
            flags.zero_()
            X.launch_main(q, kv, idx, do, lse, delta, dq, acc, None, flags, T, H, N, K, 0, T, scale,
                          scale * 1.4426950408889634, n_hb, False, mode=mode, i64_scale=2.0 ** sexp)
        run()
        torch.cuda.synchronize()
        if mode == 1:
            got = acc[:N]
        elif mode == 2:
            got = unfake(acc[:N])
        elif mode == 3:
            got = acc.view(torch.int64)[:N].double() * 2.0 ** -sexp
        else:
            got = None
        if got is not None:
            r[f"m{mode}_err_dkv"] = relerr(got.to(torch.bfloat16).float(), ref[1].float())
            r[f"m{mode}_err_dq"] = relerr(dq.float(), ref[0].float())
        if mode == 3:  # bitwise reproducible?
            a1 = acc.clone()
            run()
            r["m3_bitwise_repeat"] = bool(torch.equal(a1, acc))
        r[f"m{mode}_ms"] = bench(run)
    if cudnn_peer is not None:
        try:
            fc = cudnn_peer.make_bwd(q, kv, idx, sink, scale, out, lse, do)
            cq, ckv, cs = fc()
            r["cudnn_ms"] = bench(fc)
            r["cudnn_err_dkv"] = relerr(ckv.float(), ref[1].float())
        except Exception as e:  # noqa
            r["cudnn_error"] = str(e)[:200]
    for k in list(r):
        if k.endswith("_ms"):
            r[k.replace("_ms", "_tflops")] = round(fl / r[k] / 1e9, 1)
    rows.append(r)
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = ref = None  # free before the next shape
    torch.cuda.empty_cache()


# ---- reduction throughput probe: 64-row blocks of random rows, 64-column pieces ----
@triton.jit
def _probe(ACC, ROWS, n_blocks, MODE: tl.constexpr):
    pid = tl.program_id(0)
    r = tl.arange(0, 64)
    c = tl.arange(0, 512)
    for b in range(pid, n_blocks, tl.num_programs(0)):
        rows = tl.load(ROWS + b * 64 + r).to(tl.int64)
        v = (r[:, None] + c[None, :]).to(tl.float32) * 1e-3
        if MODE == 0:
            tl.atomic_add(ACC + rows[:, None] * 512 + c[None, :], v, sem="relaxed")
        elif MODE == 1:
            tl.atomic_add(ACC.to(tl.pointer_type(tl.int64), bitcast=True) + rows[:, None] * 512 + c[None, :],
                          v.to(tl.int64), sem="relaxed")
        else:
            tl.store(ACC + rows[:, None] * 512 + c[None, :], v)


probe = []
for R in (5120, 163840):
    n_blocks = 4096 * 10
    rows_t = torch.randint(0, R, (n_blocks * 64,), device=dev, dtype=torch.int32)
    for mode, name in ((0, "f32 atomic_add"), (1, "i64 atomic_add"), (2, "f32 store")):
        acc = torch.zeros((R, 1024 if mode == 1 else 512), dtype=torch.float32, device=dev)
        f = lambda: _probe[(132 * 4,)](acc, rows_t, n_blocks, MODE=mode, num_warps=8)
        f()
        ms = bench(f)
        gb = n_blocks * 64 * 512 * (8 if mode == 1 else 4) / ms / 1e6
        probe.append(dict(R=R, mode=name, ms=ms, payload_GBps=round(gb, 1),
                          values_per_ns=round(n_blocks * 64 * 512 / ms / 1e6, 1)))
        print(json.dumps(probe[-1]), flush=True)

json.dump(dict(rows=rows, probe=probe), open(os.path.join(OUT, "dkv_modes.json"), "w"), indent=1)
print("| T | H | K | shipped det | shipped atomic | m1 f32x2 | m2 f32x4 | m3 i64 | m4 no-red | cuDNN |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    f = lambda k: f"{r.get(k + '_tflops', float('nan')):.0f}"
    print(f"| {r['T']} | {r['H']} | {r['K']} | {f('shipped_det')} | {f('shipped_atomic')} | {f('m1')} "
          f"| {f('m2')} | {f('m3')} | {f('m4')} | {f('cudnn')} |")
