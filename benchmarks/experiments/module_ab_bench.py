"""The checkout's Gluon backward against another commit's, under the running Triton, in one
process: both modes' defaults and named schedules of each, A, B, A, B, next to cuDNN's.
For a kernel change whose PTX differs from the measured build's under some Triton (the
base is the module file as it was: ``git show COMMIT:src/dsv4_sparse_attn/kernels/backward_gluon.py``).

    git show BASE:src/dsv4_sparse_attn/kernels/backward_gluon.py > .peers/backward_gluon_base.py
    BASE_GLUON=.peers/backward_gluon_base.py PYTHONPATH=src:/tmp/cudnn_site \\
        python benchmarks/experiments/module_ab_bench.py [PEER_DIR]

Arms (``launch`` overrides, the same for both modules; ``base_`` the other commit's):
  fast, det      this Triton's defaults
  split2_dq      split 2 with dQ by TMA (Triton 3.6's fast default at K > 256, H > 32)
  split1_dq      split 1 with dQ by TMA
Checks first: the deterministic arms bitwise equal between the modules, the fast arms'
gradients against the deterministic ones (relative error). SHAPES="T,H,K;..." as
``triton_defaults_bench.py``.
"""
import importlib.util
import json
import os

import torch

import dsv4_sparse_attn  # noqa: F401
import triton
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from side_by_side import env_shapes, inputs, peer_bwd, relerr, time_arms  # (this directory)
from side_by_side import cudnn_peer as load_peer


def load_base(path):
    """The module at ``path`` as a sibling of ``backward_gluon`` (its relative imports work)."""
    spec = importlib.util.spec_from_file_location("dsv4_sparse_attn.kernels._backward_gluon_base", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


D = 512
base = load_base(os.environ["BASE_GLUON"])
cudnn_peer = load_peer()
shapes = env_shapes([
    (4096, 64, 640), (4096, 128, 1152), (4096, 128, 512), (4096, 16, 1152)])
print(json.dumps(dict(triton=triton.__version__, base=os.environ["BASE_GLUON"],
                      split_roles=backward_gluon.SPLIT_ROLES, dq_tma=backward_gluon.DQ_TMA)), flush=True)
for T, H, K in shapes:
    q, kv, idx, sink, do, out, lse = inputs(T, H, K, D)
    scale = D ** -0.5
    r = dict(T=T, H=H, K=K, triton=triton.__version__)

    def run(mod, det, **kw):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=mod, deterministic=det,
                                   **kw)

    arms = {"fast": (False, {}), "det": (True, {}), "split1_dq": (False, dict(split=1, dq_tma=1))}
    if H > 32:
        arms["split2_dq"] = (False, dict(split=2, dq_tma=1))
    ref = run(backward_gluon, True)
    r["det_bitwise_equal_base"] = all(torch.equal(a, b) for a, b in zip(ref, run(base, True)))
    for name, (det, kw) in arms.items():
        if det:
            continue
        for prefix, mod in (("", backward_gluon), ("base_", base)):
            got = run(mod, False, **kw)
            r[f"{prefix}{name}_err_dq"] = relerr(got[0].float(), ref[0].float())
            r[f"{prefix}{name}_err_dkv"] = relerr(got[1].float(), ref[1].float())
    ref = got = None
    fns = {}
    for name, (det, kw) in arms.items():
        fns[name] = lambda det=det, kw=kw: run(backward_gluon, det, **kw)
        fns["base_" + name] = lambda det=det, kw=kw: run(base, det, **kw)
    time_arms(r, fns, 10 * T * H * K * D, peer_bwd(cudnn_peer, r, q, kv, idx, sink, scale, out, lse, do))
    print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    q = kv = idx = do = out = lse = fns = None
    torch.cuda.empty_cache()
