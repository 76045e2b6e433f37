"""The deterministic fold reading whole 2 KB partial rows (512 fp32 columns a program)
against half rows (256 columns, two programs a row: the shipped width), alone on one
chunk and in the whole deterministic backward, A, B, A, B in one process.

    PYTHONPATH=src:benchmarks python benchmarks/experiments/fold_width_bench.py > fold_width.jsonl

Question: the fold reads each chunk's partial rows at about 3.2 TB/s; a row's two 1 KB
halves are read by two programs at different times. Whole rows from one program read
twice the contiguous bytes an entry (DRAM pages) and load each entry's position once.
Prediction: the fold 5-15% faster, the deterministic backward 2-6% at T = 4096; the
bits unchanged (columns are summed independently). Inputs as in ``bench.py
--backward-sweep`` (window + distinct pool ids, causal at T = 131072; D = 512, bf16, a sink).
FOLD_WIDTH_SHAPES="T,H,K,ids;..." picks the rows, FOLD_WIDTH_REPS the passes;
FOLD_WIDTH_576=1 times the 576/512 layout's masked widths instead (``v32_layout``).
(The first results, `..._fold-width_commit02e2ea8.jsonl`, name the arms bd256 / bd512.)
"""
import json
import os

import torch
import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn import testing
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon
from bench import make_inputs

dev, D = "cuda", 512
SHAPES = [(int(a), int(b), int(c), d) for a, b, c, d in (r.split(",") for r in os.environ.get(
    "FOLD_WIDTH_SHAPES",
    "4096,64,640,distinct;4096,128,1152,distinct;4096,128,512,distinct;4096,16,1152,distinct;"
    "32768,64,640,distinct;131072,64,640,causal").split(";"))]
REPS = int(os.environ.get("FOLD_WIDTH_REPS", "2"))


def fold_alone():
    """One chunk (660 tokens of H64 K640 at T = 4096) of random partial rows with real ids."""
    T, K = 4096, 640
    g = torch.Generator(device=dev).manual_seed(0)
    idx = testing.deepseek_indices(T, K, n_pool=T // 4, pool="distinct", device=dev, generator=g)
    N, chunk = T + T // 4, 660
    k = idx[:chunk].reshape(-1)
    keys = torch.where((k >= 0) & (k < N), k, N).to(torch.int16)
    sorted_ids, order = torch.sort(keys, stable=True)
    seg = torch.searchsorted(sorted_ids, torch.arange(N + 1, device=dev, dtype=torch.int16))
    partial = torch.randn(chunk, 1, K, D, device=dev)
    nbytes = int((keys < N).sum()) * D * 4
    acc0 = torch.zeros(N, D, device=dev)
    clone_ms = triton.testing.do_bench(lambda: acc0.clone(), warmup=3, rep=40)  # taken off each arm
    ref = None
    # (the last arm repeats the first: the drift of the run)
    for bd, rows, unroll, warps in ((256, 1, 8, 4), (512, 1, 8, 4), (512, 1, 8, 8), (512, 1, 4, 4),
                                    (512, 2, 4, 8), (256, 1, 8, 4)):
        def f(acc):
            kbwd._dkv_reduce_kernel[(triton.cdiv(N, rows), D // bd)](
                partial, order, seg, acc, K, K, N, D=D, BLOCK_D=bd, N_HB=1, MASK_D=False, ROWS=rows,
                UNROLL=unroll, num_warps=warps)
        a = acc0.clone()
        f(a)
        ref = a if ref is None else ref
        ms = triton.testing.do_bench(lambda: f(acc0.clone()), warmup=3, rep=40) - clone_ms
        print(json.dumps(dict(fold=f"bd{bd}_r{rows}_u{unroll}_w{warps}", bitwise=bool(torch.equal(a, ref)),
                              ms=round(ms, 4), TBps=round(nbytes / ms / 1e9, 3))), flush=True)


def sweep_case(T, H, K, ids, Dq=D, dv=None):
    """bench.py --backward-sweep's inputs (window + pool ids, a sink; D = Dq, values dv)
    and the forward's out and lse: (q, kv, idx, sink, out, lse, do)."""
    q, kv, idx, sink = make_inputs(T, H, K, Dq, pool=ids, n_pool=max(T // 4, K))
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, Dq ** -0.5, None, dv)
    return q, kv, idx, sink, out, lse, torch.randn_like(out)


def det_backward(case, knob, value):
    """The deterministic backward with ``backward.<knob>`` set to ``value`` for the call."""
    q, kv, idx, sink, out, lse, do = case
    old = getattr(kbwd, knob)
    setattr(kbwd, knob, value)
    try:
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, q.shape[-1] ** -0.5,
                                   main=backward_gluon, deterministic=True)
    finally:
        setattr(kbwd, knob, old)


def compare(r, case, knob, values, fl, rep_ms):
    """Bitwise check of every value against the first, then REPS passes of all of them."""
    ref = det_backward(case, knob, values[0])
    for v in values[1:]:
        r[f"w{v}_bitwise"] = all(torch.equal(x, y) for x, y in zip(det_backward(case, knob, v), ref))
    del ref
    for rep in range(REPS):
        for v in values:
            ms = triton.testing.do_bench(lambda: det_backward(case, knob, v), warmup=2, rep=rep_ms)
            r[f"w{v}_ms_{rep}"] = round(ms, 4)
            r[f"w{v}_tflops_{rep}"] = round(fl / ms * 1e-9, 1)
    print(json.dumps(r), flush=True)


def v32_layout():
    """The 576/512 layout (D = 576 is no multiple of 512): the deterministic backward with
    the masked width ``FOLD_BLOCK_D_MASKED`` at 256 (three programs a row, the last a
    quarter used), 512 (two) and 1024 (one, 576 of its columns used; the default since
    273a7eb, with one kv row a program as at these N)."""
    Dq, dv, T = 576, 512, 4096
    for H, K in ((64, 640), (128, 1152), (64, 2048)):
        case = sweep_case(T, H, K, "distinct", Dq, dv)
        compare(dict(T=T, H=H, K=K, D=Dq, d_v=dv), case, "FOLD_BLOCK_D_MASKED", (256, 512, 1024),
                2 * T * H * K * (3 * Dq + 2 * dv), 40)


def main():
    print(json.dumps(dict(device=torch.cuda.get_device_name(), triton=triton.__version__,
                          commit=os.environ.get("BENCH_COMMIT", "?"))), flush=True)
    if os.environ.get("FOLD_WIDTH_576") == "1":
        v32_layout()
        return
    fold_alone()
    for T, H, K, ids in SHAPES:
        rep_ms = 40 if T <= 4096 else 100 if T <= 32768 else 400
        compare(dict(T=T, H=H, K=K, ids=ids), sweep_case(T, H, K, ids), "FOLD_BLOCK_D", (256, 512),
                10 * T * H * K * D, rep_ms)


if __name__ == "__main__":
    main()
