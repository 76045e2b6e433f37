"""Benchmark of dsv4 sparse MLA on the GPU, next to plain PyTorch in the same process.

    python benchmarks/bench.py                 # the issue shapes, T=4096, D=512
    python benchmarks/bench.py --sweep         # also time candidate block configurations
    python benchmarks/bench.py --out results.md --json results.json

Indices have the DeepSeek-V4 structure: a causal window of 128 rows, then random ids
into a compressed pool of T/4 rows stored after the T raw rows. TFLOPS count every
slot, masked or not: forward 4*T*H*K*D, backward 10*T*H*K*D. "extra" is the peak
memory allocated during the call beyond its inputs and outputs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import dsv4_sparse_attn  # noqa: E402,F401
from dsv4_sparse_attn.kernels import backward as kbwd  # noqa: E402
from dsv4_sparse_attn.kernels import backward_gluon  # noqa: E402
from dsv4_sparse_attn.kernels import forward as kfwd  # noqa: E402
from dsv4_sparse_attn.kernels import forward_gluon  # noqa: E402

SHAPES = [  # (H, K, label)
    (128, 1152, "V4-Pro CSA"),
    (64, 640, "V4-Flash CSA"),
    (128, 512, "H128 K512"),
    (64, 160, "HCA S=4096"),
    (128, 128, "window only"),
    (16, 1152, "V4-Pro TP8"),
]
GIB = 2**30


def deepseek_indices(T, K, n_pool, device, window=128):
    t = torch.arange(T, device=device)[:, None]
    w = min(window, K)
    win = t - torch.arange(w - 1, -1, -1, device=device)[None, :]
    win = torch.where(win >= 0, win, torch.full_like(win, -1))
    pool = torch.randint(0, n_pool, (T, K - w), device=device) + T
    return torch.cat([win, pool], 1).to(torch.int32)


def make_inputs(T, H, K, D, dev="cuda"):
    """q, kv, idx, sink of the benchmark (seed 0): T raw kv rows, then a pool of T/4."""
    torch.manual_seed(0)
    n_pool = T // 4
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(T + n_pool, D, device=dev, dtype=torch.bfloat16)
    idx = deepseek_indices(T, K, n_pool, dev)
    sink = torch.randn(H, device=dev)
    return q, kv, idx, sink


def backward_inputs(T, H, K, D, dev="cuda"):
    """``make_inputs`` plus what a backward takes: the forward's out and lse (Triton
    kernel, scale D**-0.5) and random grad_out and grad_lse.

    Returns q, kv, idx, sink, out, lse, do, dl.
    """
    q, kv, idx, sink = make_inputs(T, H, K, D, dev)
    out, lse = kfwd.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    return q, kv, idx, sink, out, lse, do, dl


def torch_sparse_mla(q, kv, idx, sink, scale):
    """Plain PyTorch: gather the rows, bf16 matmuls, fp32 softmax with the sink. Autograd-able."""
    valid = (idx >= 0) & (idx < kv.shape[0])
    rows = kv[torch.where(valid, idx, 0).long()]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q, rows).float() * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([s, sink[None, :, None].expand(s.shape[0], -1, 1)], -1), -1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("thk,tkd->thd", p.to(q.dtype), rows)
    return out, lse


def bench(fn, rep=200):
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def peak_extra(fn, keep_bytes=0):
    """Peak bytes allocated while ``fn`` runs beyond what existed before and ``keep_bytes``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    r = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - keep_bytes
    del r
    return max(0, extra)


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def run_shape(T, H, K, D, label, with_torch=True, dev="cuda"):
    q, kv, idx, sink = make_inputs(T, H, K, D, dev)
    scale = D ** -0.5
    fl_f, fl_b = 4 * T * H * K * D, 10 * T * H * K * D
    row = dict(label=label, T=T, H=H, K=K, D=D)

    fwd = lambda: kfwd.sparse_mla_fwd(q, kv, idx, sink, scale)
    out, lse = fwd()
    row["fwd_ms"] = bench(fwd)
    row["fwd_tflops"] = fl_f / row["fwd_ms"] * 1e-9
    row["fwd_extra_gib"] = peak_extra(fwd, nbytes(out, lse)) / GIB
    row["fwd_gather_gbs"] = T * K * D * 2 / row["fwd_ms"] * 1e-6
    if forward_gluon.supported(q, D, H):
        gfwd = lambda: forward_gluon.sparse_mla_fwd(q, kv, idx, sink, scale)
        go, gl_ = gfwd()
        row["gluon_fwd_err"] = ((go.float() - out.float()).norm() / out.float().norm()).item()
        row["gluon_fwd_ms"] = bench(gfwd)
        row["gluon_fwd_tflops"] = fl_f / row["gluon_fwd_ms"] * 1e-9
        row["gluon_fwd_extra_gib"] = peak_extra(gfwd, nbytes(go, gl_)) / GIB
        del go, gl_

    do, dl = torch.randn_like(out), torch.randn_like(lse)
    # The default backward (what the op runs): the Gluon main kernel where the dispatcher
    # picks it (sm_90, D=512; per mode, backward_gluon.supported), else the Triton one;
    # "triton_" rows time the Triton main kernel on the same shapes for comparison.
    gluon_bwd = {det: backward_gluon.supported(q, D, H, deterministic=det) for det in (True, False)}
    kinds = [("", None)] + ([("triton_", False)] if any(gluon_bwd.values()) else [])
    for (prefix, force), det in itertools.product(kinds, (True, False)):
        # deterministic: the sorted per-row sum (default); else fp32 atomics
        use_gluon = gluon_bwd[det] if force is None else force
        tag = prefix + ("bwd" if det else "bwd_atomic")
        bwd = lambda: kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale, deterministic=det,
                                          gluon=use_gluon)
        g = bwd()
        row[f"{tag}_ms"] = bench(bwd)
        row[f"{tag}_tflops"] = fl_b / row[f"{tag}_ms"] * 1e-9
        row[f"{tag}_extra_gib"] = peak_extra(bwd, nbytes(*g)) / GIB
        del g

    # One training step of the op through torch.ops.dsv4.sparse_mla (autograd).
    qg, kvg, sg = (x.detach().requires_grad_() for x in (q, kv, sink))

    def step_ours():
        o, l = torch.ops.dsv4.sparse_mla(qg, kvg, idx, sg, scale)
        torch.autograd.backward((o, l), (do, dl))

    row["step_ms"] = bench(step_ours)
    if with_torch:
        tf = lambda: torch_sparse_mla(q, kv, idx, sink, scale)
        row["torch_fwd_ms"] = bench(tf, rep=100)
        row["torch_fwd_extra_gib"] = peak_extra(tf, nbytes(out, lse)) / GIB

        def step_torch():
            o, l = torch_sparse_mla(qg, kvg, idx, sg, scale)
            torch.autograd.backward((o, l), (do, dl))

        row["torch_step_ms"] = bench(step_torch, rep=100)
        row["step_speedup"] = row["torch_step_ms"] / row["step_ms"]
    return row


def sweep(T, D, dev="cuda", which="all"):
    """Time candidate block configurations on two shapes (prints; winners go in code)."""
    res = []
    for H, K in ((128, 1152), (64, 640)):
        q, kv, idx, sink, out, lse, do, dl = backward_inputs(T, H, K, D, dev)
        triton_fwd_cfgs = (kfwd.FwdConfig(64, 64, 8, 1), kfwd.FwdConfig(64, 64, 8, 2), kfwd.FwdConfig(64, 32, 8, 2),
                           kfwd.FwdConfig(64, 32, 8, 3), kfwd.FwdConfig(64, 32, 8, 4), kfwd.FwdConfig(64, 16, 8, 4))
        for cfg in triton_fwd_cfgs if which == "all" else ():
            try:
                ms = bench(lambda: kfwd.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5, config=cfg), rep=100)
                r = dict(kind="fwd", H=H, K=K, cfg=tuple(cfg), ms=ms, tflops=4 * T * H * K * D / ms * 1e-9)
            except Exception as e:  # out of resources etc.
                r = dict(kind="fwd", H=H, K=K, cfg=tuple(cfg), error=str(e)[:120])
            print(r, flush=True)
            res.append(r)
        gluon_variants = ({}, dict(BENCH_GATHER=False))  # the last: diagnostic only (wrong output)
        ref_o = None
        for var in gluon_variants if which in ("all", "gluon", "gluon+bwd") else ():
            if ref_o is None:
                ref_o = forward_gluon.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5)[0].float()
            try:
                f = lambda: forward_gluon.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5, **var)
                err = ((f()[0].float() - ref_o).norm() / ref_o.norm()).item()
                ms = bench(f, rep=100)
                r = dict(kind="gluon_fwd", H=H, K=K, variant=var, ms=ms,
                         tflops=4 * T * H * K * D / ms * 1e-9, err_vs_default=err)
            except Exception as e:
                r = dict(kind="gluon_fwd", H=H, K=K, variant=var, error=str(e)[:200])
            print(r, flush=True)
            res.append(r)
        bwd_cfgs = (kbwd.BwdConfig(64, 64, 8, 1), kbwd.BwdConfig(64, 32, 8, 2))
        budgets = (512 * 2**20, kbwd.PARTIAL_BYTES)  # the deterministic buffer: old and current bound
        sweep_bwd = which in ("all", "bwd", "gluon+bwd")
        for cfg, budget in itertools.product(bwd_cfgs, budgets) if sweep_bwd else ():
            for det in (True, False) if budget == budgets[-1] else (True,):
                kbwd.PARTIAL_BYTES, saved = budget, kbwd.PARTIAL_BYTES
                try:
                    ms = bench(lambda: kbwd.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, D ** -0.5,
                                                           deterministic=det, config=cfg), rep=100)
                    r = dict(kind="bwd" if det else "bwd_atomic", H=H, K=K, cfg=tuple(cfg), ms=ms,
                             partial_mib=budget >> 20, tflops=10 * T * H * K * D / ms * 1e-9)
                except Exception as e:
                    r = dict(kind="bwd", H=H, K=K, cfg=tuple(cfg), error=str(e)[:200])
                finally:
                    kbwd.PARTIAL_BYTES = saved
                print(r, flush=True)
                res.append(r)
    return res


def table(rows):
    hdr = ("| shape | H | K | fwd ms | fwd TFLOPS | Gluon fwd ms (TFLOPS) | fwd extra GiB | bwd ms | bwd TFLOPS | bwd extra GiB "
           "| bwd atomic ms | bwd atomic TFLOPS | Triton-main bwd TFLOPS det / atomic "
           "| torch fwd ms (TFLOPS, extra GiB) | step ms ours / torch (speedup) |")
    lines = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in rows:
        tf = 4 * r["T"] * r["H"] * r["K"] * r["D"]
        torch_col = (f"{r['torch_fwd_ms']:.2f} ({tf / r['torch_fwd_ms'] * 1e-9:.0f}, "
                     f"{r['torch_fwd_extra_gib']:.1f})" if "torch_fwd_ms" in r else "-")
        step_col = (f"{r['step_ms']:.2f} / {r['torch_step_ms']:.2f} ({r['step_speedup']:.1f}x)"
                    if "torch_step_ms" in r else f"{r['step_ms']:.2f}")
        lines.append(
            f"| {r['label']} | {r['H']} | {r['K']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | "
            + (f"{r['gluon_fwd_ms']:.3f} ({r['gluon_fwd_tflops']:.0f}) | " if "gluon_fwd_ms" in r else "- | ")
            + f"{max(r['fwd_extra_gib'], r.get('gluon_fwd_extra_gib', 0.0)):.2f} | "
            f"{r['bwd_ms']:.3f} | {r['bwd_tflops']:.0f} | {r['bwd_extra_gib']:.2f} | "
            f"{r['bwd_atomic_ms']:.3f} | {r['bwd_atomic_tflops']:.0f} | "
            + (f"{r['triton_bwd_tflops']:.0f} / {r['triton_bwd_atomic_tflops']:.0f} | " if "triton_bwd_ms" in r
               else "(same) | ")
            + f"{torch_col} | {step_col} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--D", type=int, default=512)
    ap.add_argument("--sweep", nargs="?", const="all", choices=["all", "gluon", "bwd", "gluon+bwd"])
    ap.add_argument("--shapes", default="all", help="'all' or comma-separated row numbers, e.g. 0,1")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--json")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    res = {"sweep": sweep(a.T, a.D, which=a.sweep) if a.sweep else []}
    rows = []
    shapes = SHAPES if a.shapes == "all" else [SHAPES[int(i)] for i in a.shapes.split(",")]
    for H, K, label in shapes:
        r = run_shape(a.T, H, K, a.D, label, with_torch=not a.no_torch)
        print(json.dumps(r), flush=True)
        rows.append(r)
        torch.cuda.empty_cache()
    res["rows"] = rows
    t = table(rows)
    small = [r for r in rows if r["H"] == 16]
    for r in small:
        t += (f"\n\nH={r['H']} K={r['K']}: forward gathers {r['fwd_gather_gbs']:.0f} GB/s of KV rows "
              f"(device copy ceiling about 4300 GB/s).")
    print(t)
    if a.out:
        open(a.out, "w").write(t + "\n")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
