"""The backward with the Gluon main kernel's blocks split in time (``launch(split=1)``: the
owner of a block forms all of its dKV rows while the other consumer computes the next
block's S and dP; ``split=2``: P and dS double-buffered) against the shipped schedule
(both consumers form half of every block's rows after the same hand-off), both modes, A,
B, A, B in one process, next to cuDNN's.

    PYTHONPATH=src:/tmp/cudnn_site python benchmarks/experiments/split_roles_bench.py [PEER_DIR]

Prediction (docs/performance/backward.md#split-roles): 10-25% less time
in the fast mode at T = 4096 (the softmax no longer leaves the tensor cores without an
issuer, and a block's reductions spread over twice the time), less in the deterministic
mode (its fold is unchanged). Inputs as in ``red_lines_bench.py`` (cuDNN's side-by-side
ids); the fast arms' grad_kv and grad_q checked against the deterministic backward, the
deterministic arms against each other bitwise.
"""
import json

import torch

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import bench, inputs, relerr  # (this directory)
from side_by_side import cudnn_peer as load_peer

D = 512
cudnn_peer = load_peer()
shapes = [(4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152), (4096, 32, 1152),
          (32768, 64, 640)]
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    fl = 10 * T * H * K * D
    r = dict(T=T, H=H, K=K)

    def run(det, split):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, split=split)

    ref = run(True, 0)
    for split in (1, 2):
        r[f"det_split{split}_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(ref, run(True, split)))
    for name, split in (("fast", 0), ("fast_split", 1), ("fast_split2", 2)):
        got = run(False, split)
        r[f"{name}_err_dkv"] = relerr(got[1].float(), ref[1].float())
        r[f"{name}_err_dq"] = relerr(got[0].float(), ref[0].float())
    arms = (("fast", False, 0), ("fast_split", False, 1), ("fast_split2", False, 2),
            ("det", True, 0), ("det_split", True, 1), ("det_split2", True, 2))
    for rep in range(2):  # A, B, A, B
        for name, det, split in arms:
            r[f"{name}_ms_{rep}"] = bench(lambda: run(det, split))
    for name, _, _ in arms:
        r[f"{name}_ms"] = min(r.pop(f"{name}_ms_0"), r.pop(f"{name}_ms_1"))
    if cudnn_peer is not None:
        try:
            fc = cudnn_peer.make_bwd(q, kv, idx, sink, scale, out, lse, do)
            fc()
            r["cudnn_ms"] = bench(fc)
        except Exception as e:  # noqa: BLE001
            r["cudnn_error"] = str(e)[:200]
    for k in list(r):
        if k.endswith("_ms"):
            r[k.replace("_ms", "_tflops")] = round(fl / r[k] / 1e9, 1)
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = ref = None
    torch.cuda.empty_cache()
