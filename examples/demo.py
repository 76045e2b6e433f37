"""Forward + backward of dsv4 sparse MLA on the GPU if there is one (else the CPU),
checked against the float64 reference, with timings and the kernels that ran.

    python examples/demo.py
"""
import time

import torch

import dsv4_sparse_attn
from dsv4_sparse_attn.kernels import dispatch
from dsv4_sparse_attn.kernels.common import Call
from dsv4_sparse_attn.testing import deepseek_indices, oracle_bwd, oracle_fwd, relerr


def timed(fn, dev):
    fn()  # warm-up (Triton compiles on the first call)
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return r, (time.perf_counter() - t) * 1e3


def kernels(q):
    """Which kernel runs the forward and the backward of a call with q like this one."""
    if q.device.type != "cuda":
        return "PyTorch reference (CPU)", "PyTorch reference (CPU)"
    det = dsv4_sparse_attn.deterministic_backward()
    fwd = dispatch.choose("forward", Call.of(q))[0]
    bwd = dispatch.choose("backward", Call.of(q, det))[0]
    return fwd, f"{bwd}, {'deterministic' if det else 'fast'} mode"


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # DeepSeek-V4-Flash CSA layer on the GPU; a small one on the CPU (the reference runs there).
    T, H, D, K = (4096, 64, 512, 640) if dev == "cuda" else (256, 16, 512, 160)
    dtype = torch.bfloat16
    n_pool = T // 4
    q = torch.randn(T, H, D, device=dev, dtype=dtype, requires_grad=True)
    kv = torch.randn(T + n_pool, D, device=dev, dtype=dtype, requires_grad=True)
    sink = torch.randn(H, device=dev, requires_grad=True)
    # A causal window of 128 rows (-1 before 0), then random ids into a pool of T/4 rows.
    idx = deepseek_indices(T, K, window=128, n_pool=n_pool, device=dev)

    (out, lse), ms_f = timed(lambda: dsv4_sparse_attn.sparse_mla(q, kv, idx, sink, return_lse=True), dev)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    grads, ms_b = timed(lambda: torch.autograd.grad((out, lse), (q, kv, sink), (do, dl), retain_graph=True),
                        dev)

    # float64 reference on the CPU
    o64, l64 = oracle_fwd(q, kv, idx, sink)
    g64 = oracle_bwd(do, dl, q, kv, idx, sink)
    fwd_kernel, bwd_kernel = kernels(q)
    flops = 4 * T * H * K * D
    print(f"device {dev}  T={T} H={H} D={D} K={K} bf16")
    print(f"kernels: forward {fwd_kernel}; backward {bwd_kernel}")
    print(f"forward  {ms_f:8.2f} ms  {flops / ms_f * 1e-9:7.2f} TFLOPS   "
          f"rel.err out {relerr(out, o64):.1e}  lse {relerr(lse, l64):.1e}")
    print(f"backward {ms_b:8.2f} ms  {2.5 * flops / ms_b * 1e-9:7.2f} TFLOPS   "
          f"rel.err dq {relerr(grads[0], g64[0]):.1e}  dkv {relerr(grads[1], g64[1]):.1e}  "
          f"dsink {relerr(grads[2], g64[2]):.1e}")


if __name__ == "__main__":
    main()
