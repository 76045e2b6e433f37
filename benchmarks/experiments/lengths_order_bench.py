"""With topk_length: the Gluon kernels' length-balanced tile order (hopper.balanced_order)
against the natural token order, in one process, repeated (variance check).

    PYTHONPATH=src:benchmarks python benchmarks/experiments/lengths_order_bench.py

Inputs as features_bench.py's "lengths" rows (T = 4096, lengths uniform in [128, K]).
"""
import json

import torch
import triton

import features_bench as F
from dsv4_sparse_attn.kernels import backward_gluon, forward_gluon, hopper

shipped = hopper.balanced_order


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def natural(topk_length, chunk, programs, n_hb):
    T = topk_length.shape[0]
    return (torch.arange(T, device=topk_length.device, dtype=torch.int32) % chunk).contiguous()


def use(order_fn):
    hopper.balanced_order = order_fn
    forward_gluon.balanced_order = order_fn
    backward_gluon.balanced_order = order_fn


for H, K in ((64, 640), (128, 1152), (64, 2048)):
    T = 4096
    q, kv, idx, sink = F.inputs(T, H, K, 512)
    g = torch.Generator(device="cuda").manual_seed(1)
    length = torch.randint(128, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    for rep in range(2):
        for name, fn in (("balanced", shipped), ("natural", natural)):
            use(fn)
            row = dict(H=H, K=K, rep=rep, order=name)
            row["fwd_ms"] = bench(lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length))
            for mode, det in (("fast", False), ("det", True)):
                with F.backward_mode(det):
                    row[f"{mode}_ms"] = bench(lambda: torch.ops.dsv4.sparse_mla_bwd(
                        do, dl, q, kv, out, lse, idx, sink, None, length))
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
    use(shipped)
