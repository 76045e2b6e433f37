"""Forward + backward of dsv4 sparse MLA on the GPU if there is one (else the CPU),
checked against the float64 reference, with timings.

    python examples/demo.py
"""
import time

import torch

import dsv4_sparse_attn
from dsv4_sparse_attn import reference


def relerr(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).norm() / ref.norm()).item()


def timed(fn, dev):
    fn()  # warm-up (Triton compiles on the first call)
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    r = fn()
    if dev == "cuda":
        torch.cuda.synchronize()
    return r, (time.perf_counter() - t) * 1e3


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # DeepSeek-V4-Flash CSA layer on the GPU; a small one on the CPU (the reference runs there).
    T, H, D, K = (4096, 64, 512, 640) if dev == "cuda" else (256, 16, 512, 160)
    dtype = torch.bfloat16
    n_pool = T // 4
    q = torch.randn(T, H, D, device=dev, dtype=dtype, requires_grad=True)
    kv = torch.randn(T + n_pool, D, device=dev, dtype=dtype, requires_grad=True)
    sink = torch.randn(H, device=dev, requires_grad=True)
    t = torch.arange(T, device=dev)[:, None]
    window = t - torch.arange(127, -1, -1, device=dev)[None, :]  # causal window, -1 before 0
    window = torch.where(window >= 0, window, -1)
    pool = T + torch.randint(0, n_pool, (T, K - 128), device=dev)
    idx = torch.cat([window, pool], 1).to(torch.int32)

    (out, lse), ms_f = timed(lambda: dsv4_sparse_attn.sparse_mla(q, kv, idx, sink, return_lse=True), dev)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    grads, ms_b = timed(lambda: torch.autograd.grad((out, lse), (q, kv, sink), (do, dl), retain_graph=True), dev)

    # float64 reference on the CPU
    q64, kv64, s64 = (x.detach().double().cpu() for x in (q, kv, sink))
    o64, l64 = reference.sparse_mla_fwd(q64, kv64, idx.cpu(), s64, D ** -0.5)
    g64 = reference.sparse_mla_bwd(do.double().cpu(), dl.double().cpu(), q64, kv64, o64, l64, idx.cpu(), s64,
                                   D ** -0.5)
    flops = 4 * T * H * K * D
    print(f"device {dev}  T={T} H={H} D={D} K={K} bf16  (kernels: {'Triton' if dev == 'cuda' else 'PyTorch reference'})")
    print(f"forward  {ms_f:8.2f} ms  {flops / ms_f * 1e-9:7.2f} TFLOPS   rel.err out {relerr(out, o64):.1e}  "
          f"lse {relerr(lse, l64):.1e}")
    print(f"backward {ms_b:8.2f} ms  {2.5 * flops / ms_b * 1e-9:7.2f} TFLOPS   rel.err dq {relerr(grads[0], g64[0]):.1e}  "
          f"dkv {relerr(grads[1], g64[1]):.1e}  dsink {relerr(grads[2], g64[2]):.1e}")


if __name__ == "__main__":
    main()
