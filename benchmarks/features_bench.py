"""Per-token top-k lengths and the DeepSeek-V3.2 / GLM-5 layout on one CUDA GPU: what they cost
next to the plain D = 512 call, in the same process.

    python benchmarks/features_bench.py              # T=4096; (H, K) = (64, 640), (128, 1152), (64, 2048)
    python benchmarks/features_bench.py --quick      # one shape, short timings (smoke run)

Per (H, K), bf16, a sink, DeepSeek ids (``testing.deepseek_indices``, uniform pool ids), seed 0:

- ``full``: D = 512, every slot (the reference point);
- ``lengths``: D = 512 with ``topk_length`` drawn uniformly from [128, K] per token; its time
  over the full call's is what the lengths save (FLOPs are counted for all K slots);
- ``v32``: q and kv 576 wide, ``d_v=512``: TFLOPS count forward 2*T*H*K*(D + d_v) and backward
  2*T*H*K*(3*D + 2*d_v) (4THKD and 10THKD at D = d_v = 512), next to ``full``'s TFLOPS.

Each: the forward, and the backward (``torch.ops.dsv4.sparse_mla_bwd``) in the fast and the
deterministic mode, with the kernel the dispatcher picks (named in the table). JSON rows in
benchmarks/results/<date>_<gpu>_triton<version>_features.json (or ``--json PATH``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

from bench import GIB, RESULTS_DIR, TIMING, backward_mode, bench, document, flops, require_cuda, slug, write
from dsv4_sparse_attn import testing
from dsv4_sparse_attn.kernels import dispatch
from dsv4_sparse_attn.kernels.common import Call

SHAPES = ((64, 640), (128, 1152), (64, 2048))
D_V = 512


def inputs(T, H, K, D, seed=0):
    torch.manual_seed(seed)
    n_pool = max(T // 4, K)
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T + n_pool, D, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = testing.deepseek_indices(T, K, n_pool=n_pool, device="cuda", generator=g)
    sink = torch.randn(H, device="cuda")
    return q, kv, idx, sink


def variant(T, H, K, name, timing):
    D = D_V + 64 if name == "v32" else D_V
    d_v = D_V if name == "v32" else None
    q, kv, idx, sink = inputs(T, H, K, D)
    length = None
    if name == "lengths":
        g = torch.Generator(device="cuda").manual_seed(1)
        length = torch.randint(min(128, K), K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
    fwd_flops, bwd_flops = flops(T, H, K, D, D_V)

    def fwd():
        return torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length, d_v)

    out, lse = fwd()
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    call = Call.of(q, d_v=D_V, has_len=length is not None)
    row = {"T": T, "H": H, "K": K, "variant": name, "D": D, "d_v": D_V,
           "mean_length": None if length is None else length.float().mean().item(),
           "forward": {"kernel": dispatch.choose("forward", call)[0]}}
    ms = bench(fwd, *timing)
    row["forward"].update(ms=ms, tflops=fwd_flops / ms * 1e-9)
    for mode, det in (("fast", False), ("deterministic", True)):
        with backward_mode(det):
            def bwd():
                return torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, None, length, d_v)
            ms = bench(bwd, *timing)
            bwd_call = Call.of(q, det, d_v=D_V, has_len=length is not None)
            row[mode] = {"kernel": dispatch.choose("backward", bwd_call)[0], "ms": ms,
                         "tflops": bwd_flops / ms * 1e-9}
    return row


def table(rows):
    lines = ["| T | H | K | variant | forward ms (TFLOPS) | bwd fast ms (TFLOPS) | bwd det ms (TFLOPS) "
             "| time / full (fwd, fast, det) | TFLOPS / full (fwd, fast, det) | kernels |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    full = {(r["T"], r["H"], r["K"]): r for r in rows if r["variant"] == "full"}
    for r in rows:
        f = full.get((r["T"], r["H"], r["K"]))
        parts = ("forward", "fast", "deterministic")
        cells = [f"{r[p]['ms']:.3f} ({r[p]['tflops']:.0f})" for p in parts]
        t_ratio = ", ".join(f"{r[p]['ms'] / f[p]['ms']:.2f}" for p in parts) if f else "-"
        f_ratio = ", ".join(f"{r[p]['tflops'] / f[p]['tflops']:.2f}" for p in parts) if f else "-"
        kernels = " / ".join(r[p]["kernel"] for p in parts)
        lines.append(f"| {r['T']} | {r['H']} | {r['K']} | {r['variant']} | {' | '.join(cells)} | {t_ratio} "
                     f"| {f_ratio} | {kernels} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description="topk_length and the 576/512 layout next to the plain D = 512 "
                                             "call (forward, backward in both modes) on one CUDA GPU.")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="one shape, short timings (smoke run)")
    ap.add_argument("--json", metavar="PATH", help="results JSON (default: benchmarks/results/"
                    "<date>_<gpu>_triton<version>_features.json)")
    a = ap.parse_args(argv)
    require_cuda("features_bench.py")
    timing = TIMING["quick" if a.quick else "table"]
    doc = document("features", {"T": a.T, "dtype": "bfloat16", "sink": True, "seed": 0,
                                "lengths": "uniform in [128, K] per token (seed 1)", "d_v": D_V}, a.quick)
    path = a.json or os.path.join(
        RESULTS_DIR, f"{doc['date']}_{slug(doc['gpu']['name'])}_triton{triton.__version__}_features"
                     f"{'_quick' if a.quick else ''}.json")
    for H, K in SHAPES[:1] if a.quick else SHAPES:
        for name in ("full", "lengths", "v32"):
            print(f"H={H} K={K} {name}", flush=True)
            try:
                row = variant(a.T, H, K, name, timing)
            except Exception as e:  # noqa: BLE001  (one failure costs one row)
                print(f"  error: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
                continue
            doc["rows"].append(row)
            print(json.dumps(row), flush=True)
            write(doc, path)
            torch.cuda.empty_cache()
    doc["complete"] = True
    write(doc, path)
    print("\n" + table(doc["rows"]))
    print(f"\nwrote {path} (peak memory {torch.cuda.max_memory_allocated() / GIB:.1f} GiB)")


if __name__ == "__main__":
    main()
