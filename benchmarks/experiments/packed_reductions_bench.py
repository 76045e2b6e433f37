"""What exact dKV sums would cost the fast backward: its reductions as two s32 words a
``red.add.u64`` (``launch(ablate=64)``, ``hopper.red_s32x2_lines``: each value scaled and
rounded, the words of a line's 64-byte half in one instruction), next to the kernel as
shipped, with every reduction predicated off (``ablate=8``), the deterministic mode and
cuDNN's backward, A, B, A, B in one process; ``packed_raw`` (``ablate=64 | 128``) sends the
same words unconverted (the fp32 bits), so packed - packed_raw is the conversion's cost and
packed_raw - fast the 64-bit reductions' and their exchange's. Timing only: the packed
arms' grad_kv is s32 words read as fp32. ``grid`` (``ablate=256``,
``hopper.red_f32x4_lines_grid``): the fast mode's fp32 lines with each value first rounded
to a grid by two adds (exact fp32 sums on a per-row grid: open lead 3). ARMS="fast,grid"
runs only those arms (and cuDNN); SHAPES="T,H,K;...".

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/packed_reductions_bench.py [PEER_DIR]

Question (docs/performance/backward.md#open-leads, item 2): one s32 word a value on a
per-row grid is exact in any order and precise enough with the mass bound; scalar
``red.add.s32`` cost 1.4-1.5x the fast mode's time at best (3.3x its reductions' share).
Two words a 64-bit add halve those instructions. Prediction from the L2 side (a fit of the
reductions' share to instructions and row requests): share 0.84 ms at H64 K640 (fp32
lines 0.42), the kernel about 1.2x the fast mode's. From the issue side (static, Triton
3.6.0, split 2 with dQ by TMA): the block loops grow from 2483 to 4525 instructions (3887
unconverted; no reload either; the rounding is a quarter-rate F2I a value), so the
consumers may become issue-bound: 1.2-1.6x.

The grid arm (static, Triton 3.6.0, split 2 with dQ by TMA): the same 64 reductions a loop,
2996 / 3014 instructions against 2484 / 2502 (512 full-rate FADDs more), no reload.
Prediction: 1.05-1.15x the fast mode's time (below packed_raw's 1.28x: no 64-bit
reductions, no exchange of words, a third of its added instructions).
Measured (H100 SXM, 3a0ab85): 1.029x / 1.032x at H64 K640 / H128 K1152; the packed arm
1.61-1.70x (c5b1ffe): docs/performance/backward.md#the-grid-rounding-in-the-fast-kernel-measured.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
import triton
from side_by_side import env_shapes, gluon_backward, inputs, peer_bwd, time_arms  # (this directory)
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
shapes = env_shapes([
    (4096, 64, 640), (4096, 128, 1152), (4096, 128, 512)])
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    r = dict(T=T, H=H, K=K, triton=triton.__version__)
    run = gluon_backward(q, kv, idx, sink, do, out, lse, scale)

    fns = {"fast": lambda: run(False), "packed": lambda: run(False, ablate=64),
           "packed_raw": lambda: run(False, ablate=64 | 128),
           "no_reductions": lambda: run(False, ablate=8), "det": lambda: run(True),
           "grid": lambda: run(False, ablate=256)}
    if os.environ.get("ARMS"):
        keep = set(os.environ["ARMS"].split(",")) | {"fast"}
        fns = {k: v for k, v in fns.items() if k in keep}
    time_arms(r, fns, 10 * T * H * K * D, peer_bwd(cudnn_peer, r, q, kv, idx, sink, scale, out, lse, do))
    for arm in ("packed", "grid"):
        if f"{arm}_ms" in r:
            r[f"{arm}_over_fast"] = round(r[f"{arm}_ms"] / r["fast_ms"], 3)
    if "packed_ms" in r and "no_reductions_ms" in r:
        r["packed_share_over_fast_share"] = round((r["packed_ms"] - r["no_reductions_ms"])
                                                  / max(r["fast_ms"] - r["no_reductions_ms"], 1e-6), 2)
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = fns = run = None  # (run holds the tensors too)
    torch.cuda.empty_cache()
