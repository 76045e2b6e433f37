"""The Delta kernel (``backward._bwd_delta_kernel``: rowsum(O * dO) - dLSE) in other
launch shapes: heads a program (``BLOCK_H``) and warps. It reads O and dO whole (537 MB at
T = 4096, H = 64) before the main kernel, about 130 us at H64 and 254 at H128 (3.4-5.7% of
the fast backward), at about 4.1 TB/s against the H200's 4.8.

    PYTHONPATH=src python benchmarks/experiments/delta_config_bench.py

Prediction: more bytes in flight a program (32 heads, 8 warps) moves it toward 4.4-4.5 TB/s,
10-20 us less at H = 64 (under 1% of the backward); fewer heads a program, less.
"""
import json

import torch
import triton

from dsv4_sparse_attn.kernels import backward as kbwd

dev = "cuda"
CONFIGS = [(16, 4), (16, 8), (32, 4), (32, 8), (8, 4), (64, 8), (4, 2)]  # (BLOCK_H, warps); first: shipped


def main():
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    for T, H in ((4096, 64), (4096, 128), (32768, 64)):
        D = 512
        out = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        do = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        dl = torch.randn(T, H, device=dev)
        ref = (out.float() * do.float()).sum(-1) - dl
        row = dict(T=T, H=H)
        for bh, warps in CONFIGS:
            delta = torch.empty(T, H, device=dev)

            def f(bh=bh, warps=warps, delta=delta):
                kbwd._bwd_delta_kernel[(T, triton.cdiv(H, bh))](
                    out, do, dl, delta, H, out.stride(0), out.stride(1), do.stride(0), do.stride(1),
                    dl.stride(0), D=D, BLOCK_H=bh, HAS_DLSE=True, num_warps=warps)
            f()
            err = ((delta - ref).abs().max() / ref.abs().max()).item()
            ms = do_bench(f, warmup=10, rep=50)
            row[f"{bh}x{warps}"] = dict(us=round(ms * 1e3, 1), TBps=round(2 * out.numel() * 2 / ms / 1e9, 2),
                                        rel_err=float(f"{err:.1e}"))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
