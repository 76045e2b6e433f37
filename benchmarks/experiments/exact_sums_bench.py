"""The deterministic backward with exact two-word sums (``kernels/exact_sums.py``: one
launch, the fast mode's reductions with each value split into two words on its row's grid)
next to the partial rows and their sorted fold (``exact=False``, the deterministic mode up
to this change), the fast mode and cuDNN's backward, A, B, A, B in one process. Checks per
shape: the exact mode's grad_q, grad_kv and grad_sink bitwise equal over three calls, and
with the tokens permuted (grad_kv's rows summed in another order); each mode's grad_kv
against the fast mode's (fp32 sums) and against cuDNN's; the time of the bound and codes
alone (``row_codes``). SHAPES="T,H,K;...".

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/exact_sums_bench.py [PEER_DIR]

Prediction (static, Triton 3.6.0, split 2 with dQ by TMA: block loops of 4481 / 4498
instructions against the fast mode's 2484 / 2502, 128 16-byte reductions a loop against
64, 1280 FADDs more, no reload): the reductions' bytes double (the grid arm's 1.03x plus
the unconverted 64-bit words' 1.25-1.28x share), and the consumers issue 1.8x the
instructions: 1.15-1.35x the fast mode's time, against 2.2x for the fold; the bound's
pass (q, dO read once more; three integer atomics a slot) 2-4% of the fast mode's time.
Measured (H100 SXM, Triton 3.6.0): 2.09-2.27x, the bound's pass 0.4-0.45x of it, grad_kv
1e-2 to 1e-1 off the fast mode's on heavily shared rows: the option stays off
(docs/performance/backward.md#exact-two-word-sums-measured-off).
"""
import json

import torch

import dsv4_sparse_attn  # noqa: F401
import triton
from side_by_side import bench, env_shapes, gluon_backward, inputs, peer_bwd, relerr, time_arms
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
shapes = env_shapes([(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152),
                     (4096, 32, 1152)])
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    r = dict(T=T, H=H, K=K, triton=triton.__version__, gpu=torch.cuda.get_device_name())
    run = gluon_backward(q, kv, idx, sink, do, out, lse, scale)
    fns = {"fast": lambda: run(False), "exact": lambda: run(True, exact=True),
           "fold": lambda: run(True, exact=False)}
    peer = peer_bwd(cudnn_peer, r, q, kv, idx, sink, scale, out, lse, do)
    time_arms(r, fns, 10 * T * H * K * D, peer)
    for arm in ("exact", "fold"):
        r[f"{arm}_over_fast"] = round(r[f"{arm}_ms"] / r["fast_ms"], 3)
        if "cudnn_ms" in r:
            r[f"{arm}_vs_cudnn"] = round(r["cudnn_ms"] / r[f"{arm}_ms"], 3)
    r["fast_vs_cudnn"] = round(r["cudnn_ms"] / r["fast_ms"], 3) if "cudnn_ms" in r else None

    # the bound's pass alone
    from dsv4_sparse_attn.kernels import exact_sums
    delta = torch.randn(T, H, device="cuda")
    r["codes_ms"] = round(bench(lambda: exact_sums.row_codes(q, kv, idx, do, delta, scale)), 4)

    # bits: three calls, and the tokens permuted
    a = run(True, exact=True)
    same = all(all(torch.equal(x, y) for x, y in zip(a, run(True, exact=True))) for _ in range(2))
    perm = torch.randperm(T, device="cuda")
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_gluon
    b = kbwd.sparse_mla_bwd(do[perm], None, q[perm], kv, out[perm], lse[perm], idx[perm], sink, scale,
                            main=backward_gluon, deterministic=True, exact=True)
    r["exact_bitwise_3_calls"] = same
    r["exact_bitwise_tokens_permuted"] = torch.equal(a[1], b[1]) and torch.equal(a[0][perm], b[0])
    f = run(False)
    fo = run(True, exact=False)
    r["exact_dkv_vs_fast"] = relerr(a[1], f[1])
    r["fold_dkv_vs_fast"] = relerr(fo[1], f[1])
    r["exact_dq_vs_fast"] = relerr(a[0], f[0])
    r["exact_dsink_vs_fast"] = relerr(a[2], f[2])
    if peer is not None:
        try:
            c = peer()
            r["cos_exact_cudnn_dkv"] = torch.nn.functional.cosine_similarity(
                a[1].double().flatten(), c[1].double().flatten(), dim=0).item()
        except Exception as e:  # noqa: BLE001
            r["cudnn_grad_error"] = str(e)[:100]
    print(json.dumps({k: (round(v, 8) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = fns = run = a = b = f = fo = peer = None
    torch.cuda.empty_cache()
