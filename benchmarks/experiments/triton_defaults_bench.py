"""The Gluon backward's options that are on by default only under the Triton they were
measured with (3.6; split roles also 3.8), timed under the running Triton: each against
this Triton's defaults, both modes, A, B, A, B in one process, next to cuDNN's. For
deciding another Triton's defaults (3.9 is what a fresh `pip install torch` brings: torch
2.15 requires triton 3.9), run under it (`benchmarks/gpu_session.sh triton-next` with
TRITON_NEXT_BENCH=triton_defaults_bench.py).

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/triton_defaults_bench.py [PEER_DIR]

Arms (``backward_gluon.launch`` overrides; "fast" and "det" are whatever this Triton runs):
  dqtma        dQ staged in q's quarters and stored by TMA (3.6 default), this Triton's schedule
  split1(_dq)  the blocks' roles split in time, P and dS single-buffered (with dQ by TMA)
  split2_dq    split roles, P and dS double-buffered, dQ by TMA (3.6's fast default)
  qdtma        K <= 256: q and dO by TMA (3.6 default there), this Triton's schedule;
               split1_qd the same with split 1 (and the early release of q's quarters);
               split2_qd_dq split 2, q and dO and dQ by TMA (3.6's default there, H > 32)
  trans_dq     H <= 32: the small-head tiles transposed, split 2, dQ by TMA (3.6 default)
  det_dqtma    deterministic with dQ by TMA (3.6 default)
  det_split1   deterministic, one head block, K >= 512, split 1 (3.6 / 3.8 default)
  det_pairs    deterministic, one head block, its build with the head-block pairs' code
               (``pairs_code=True``: 3.9's build before 2026-12-05; the same build elsewhere)
  det_16       deterministic with 16-bit partial rows, where this Triton's default is fp32
               rows (3.6 takes them by default: ``backward_gluon.partial16_default``)
  det_nopairs  the same without that code (``pairs_code=False``: 3.9's build; under 3.6
               with fp32 rows, split 1 with dQ by TMA, a block loop of 1514 instructions
               instead of 2081, no reload either way: timed within 0.5%; with 16-bit rows at
               64 heads a tile its build serialises the wgmmas: +22% at H64 K640, H100, 5a5f469)
  fast_nopairs the fast default without the pairs' code (``pairs_code=False``:
               3.9's fast build; under 3.6, split 2 with dQ by TMA, 2379 instructions a
               block loop instead of 2483, no reload either way: predicted level, L2-bound)
Checks first: every deterministic arm bitwise equal to this Triton's deterministic default,
every fast arm's grad_q and grad_kv against it (relative error, printed).

Since 2a5ccf7 split 2 under 3.9 reloads 4-5 values a loop (17-20 before): predicted
level with split 1 or better, as under 3.6, where it gained 1-5%.

Prediction (sm_90 builds under 3.9.0, block-loop reloads fast / deterministic,
docs/performance/backward.md#defaults-by-triton-version-static): 3.9's defaults (unsplit)
reload 5-6 / 3 values a loop (9 at H = 128, with the head-block pairs); dQ by TMA leaves
them as they are and split 1 takes the fast mode's to 4-5 (3-4 with dQ by TMA), split 2
to 17-20; the transposed small-head tiles reload none (5-6 for 3.9's unsplit tiles at
H <= 32); the deterministic split 1 3. So: dqtma, split1_dq, trans_dq and det_split1
faster than 3.9's defaults by about what they gained under 3.6 (dQ by TMA 5-11 us a tile,
the transposed tiles 3-6%, the deterministic split 1 1.4-3.2%), split2_dq slower. Under
3.7 and 3.8, whose builds of every arm reload nothing, each arm gains what it did under 3.6.
"""
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
import triton
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import env_shapes, gluon_backward, inputs, peer_bwd, relerr, time_arms  # (this directory)
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
# SHAPES="T,H,K;..." (and ARMS, below) to run fewer (a call has about 5 minutes for the script)
shapes = env_shapes([(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 64, 160), (4096, 16, 1152),
                     (4096, 32, 1152)])
print(json.dumps(dict(triton=triton.__version__, split_roles=backward_gluon.SPLIT_ROLES,
                      dq_tma=backward_gluon.DQ_TMA, qd_tma_max_k=backward_gluon.QD_TMA_MAX_K,
                      small_h_transposed=backward_gluon.SMALL_H_TRANSPOSED)), flush=True)
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    r = dict(T=T, H=H, K=K, triton=triton.__version__)
    run = gluon_backward(q, kv, idx, sink, do, out, lse, scale)

    fast = {"fast": {}, "dqtma": dict(dq_tma=1), "split1": dict(split=1),
            "split1_dq": dict(split=1, dq_tma=1)}
    fast["fast_nopairs"] = dict(pairs_code=False)  # (3.9's fast build; under 3.6 4% fewer instructions)
    if H > 32:
        fast["split2_dq"] = dict(split=2, dq_tma=1)
    else:
        fast["trans_dq"] = dict(split=2, transposed=True, dq_tma=1)
    if K <= 256:
        fast["qdtma"] = dict(qd_tma=True)
        fast["split1_qd"] = dict(split=1, qd_tma=True)
        if H > 32:  # (3.6's default there)
            fast["split2_qd_dq"] = dict(split=2, qd_tma=True, dq_tma=1)
    det = {"det": {}, "det_dqtma": dict(dq_tma=1)}
    if H <= 64 and K >= 512:
        det["det_split1"] = dict(split=1)
    if H <= 64:  # the head-block pairs' code kept (the build before it was left out under 3.9)
        det["det_pairs"] = dict(pairs_code=True)
        det["det_nopairs"] = dict(pairs_code=False)
    # 16-bit partial rows where this Triton's default is fp32 rows (``partial16_default``):
    # other bits in grad_kv (within fp16's rounding of each row), the same grad_q and grad_sink
    if not backward_gluon.partial16_default(D, D):
        det["det_16"] = dict(partial16=True)
    if os.environ.get("ARMS"):  # ARMS="fast,det,det_nopairs": only these arms
        keep = set(os.environ["ARMS"].split(","))
        fast = {k: v for k, v in fast.items() if k in keep | {"fast"}}
        det = {k: v for k, v in det.items() if k in keep | {"det"}}
    ref = run(True)
    for name, kw in det.items():
        if name == "det_16":
            got = run(True, **kw)
            r["det_16_err_dkv"] = relerr(got[1].float(), ref[1].float())
            r["det_16_dq_dsink_equal"] = torch.equal(got[0], ref[0]) and torch.equal(got[2], ref[2])
            r["det_16_bitwise_rerun"] = all(torch.equal(a, b) for a, b in zip(got, run(True, **kw)))
        elif kw:
            r[f"{name}_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(ref, run(True, **kw)))
    for name, kw in fast.items():
        got = run(False, **kw)
        r[f"{name}_err_dq"] = relerr(got[0].float(), ref[0].float())
        r[f"{name}_err_dkv"] = relerr(got[1].float(), ref[1].float())
    ref = got = None
    fns = {name: (lambda kw=kw: run(False, **kw)) for name, kw in fast.items()}
    fns.update({name: (lambda kw=kw: run(True, **kw)) for name, kw in det.items()})
    time_arms(r, fns, 10 * T * H * K * D, peer_bwd(cudnn_peer, r, q, kv, idx, sink, scale, out, lse, do))
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = fns = run = None  # (run holds the tensors too)
    torch.cuda.empty_cache()
