"""A small forward + backward with out-of-range and negative ids, for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/sanitize_case.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from dsv4_sparse_attn.kernels import backward as kbwd  # noqa: E402
from dsv4_sparse_attn.kernels import backward_gluon  # noqa: E402
from dsv4_sparse_attn.kernels import forward as kfwd  # noqa: E402
from dsv4_sparse_attn.kernels import forward_gluon  # noqa: E402

T, N, K = 37, 50, 77
for H, D in ((128, 512), (100, 512), (16, 512), (5, 128)):
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(-N, 2 * N, (T, K), device="cuda", dtype=torch.int32)
    idx[:, 0] = 2**31 - 1
    idx[:, 1] = -(2**31)
    idx[3] = -1
    sink = torch.randn(H, device="cuda")
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5)
    if forward_gluon.supported(q, D, H):  # the default forward for D=512, H>=64 on sm_90
        go, gl_ = forward_gluon.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5)
        assert torch.isfinite(go).all()
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    for det in (True, False):
        g = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, D ** -0.5, deterministic=det)
        if backward_gluon.supported(q, D, H):  # the default main kernel for D=512, H>=64 on sm_90
            gg = kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, D ** -0.5, deterministic=det,
                                     gluon=True)
            assert all(torch.isfinite(x).all() for x in gg)
    torch.cuda.synchronize()
    print("H", H, "D", D, "ok", bool(torch.isfinite(out).all()), bool(torch.isfinite(g[0]).all()))
