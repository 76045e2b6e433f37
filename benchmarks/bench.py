"""Benchmark of dsv4 sparse MLA on one CUDA GPU, next to plain PyTorch in the same process.

    python benchmarks/bench.py                       # the default table (T=4096, D=512)
    python benchmarks/bench.py --quick               # two shapes, short timings (smoke run)
    python benchmarks/bench.py --backward-sweep [--cudnn DIR]   # the backward side by side
    python benchmarks/report.py                      # README tables and docs/performance/bench.png

Default table: T=4096, D=512 (then three rows of the 576/512 layout: D=576, d_v=512), bf16,
a sink, DeepSeek ids (``dsv4_sparse_attn.testing.
deepseek_indices(pool="random")``: a causal window of 128 rows, then uniform ids into a pool
of T/4 compressed rows stored after the T raw rows), seed 0. Per shape: the forward with the
kernel the dispatcher picks and, where both take the call, with "gluon_sm90" and "triton"
forced (``use_kernels``); the backward (``torch.ops.dsv4.sparse_mla_bwd``, random grad_out
and grad_lse) in the fast and the deterministic mode with the default kernel and with
"triton" forced; a training step (``torch.ops.dsv4.sparse_mla`` forward + autograd backward)
in the default mode; the same forward and step in plain PyTorch.

``--backward-sweep``: the backward at T = 4096, 32768 and 131072, both modes, with plain
PyTorch where its gathered rows fit (T*K*D*2 bytes < 8 GiB) and cuDNN-frontend's sm90 DSA
backward with ``--cudnn DIR`` (DIR holds ``cudnn_peer.py``). Ids as cuDNN's side-by-side
script makes them: window + distinct pool ids, N = T + max(T/4, K); at T = 131072 causal pool
ids (and a T = 4096 causal row to compare with). No grad_lse (cuDNN takes none). Our two
modes and cuDNN are timed twice, in reverse order the second time (cuDNN first), each
keeping its better time.

TFLOPS count every slot, masked or not: forward 4*T*H*K*D, backward 10*T*H*K*D (with d_v:
2*T*H*K*(D + d_v) and 2*T*H*K*(3*D + 2*d_v)), over the
median time of a call (``triton.testing.do_bench``, L2 flushed before each timed call; calls
over 100 ms: one warm-up and three calls timed with CUDA events). "extra" is the peak memory
allocated during a call beyond its inputs and outputs.

Results: JSON in benchmarks/results/<date>_<gpu>_triton<version>[_bwd-sweep][_quick].json
(or ``--json PATH``), written after every row, and a Markdown table at the end.
The JSON schema is checked by ``report.validate`` (benchmarks/report.py).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys

import torch
import triton
import triton.testing

import dsv4_sparse_attn
from dsv4_sparse_attn import testing
from dsv4_sparse_attn.kernels import dispatch
from dsv4_sparse_attn.kernels.common import Call

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")

SHAPES = [  # (H, K, label)
    (128, 1152, "V4-Pro CSA"),
    (64, 640, "V4-Flash CSA"),
    (128, 512, "H128 K512"),
    (64, 160, "HCA S=4096"),
    (128, 128, "window only"),
    (16, 1152, "V4-Pro TP8"),
    (32, 1152, "V4-Pro TP4"),
]
QUICK_SHAPES = (1, 5)  # V4-Flash CSA (the Gluon kernels) and V4-Pro TP8 (Triton forward)
# The DeepSeek-V3.2 / GLM-5 layout after the D = 512 rows: q.k over 576 columns, values over
# the first 512 (d_v); (H, K, label), run at D = 576, d_v = 512 unless --no-v32.
V32_SHAPES = [
    (64, 640, "V3.2 layout"),
    (128, 1152, "V3.2 layout"),
    (64, 2048, "V3.2 layout"),
]
V32_D, V32_DV = 576, 512

# The backward side by side: (T, H, K, ids).
SWEEP = (  # T = 4096 first: a run cut short by its time limit keeps the most-used rows
    [(4096, H, K, "distinct") for H, K in ((64, 640), (128, 1152), (128, 512), (16, 1152), (32, 1152))]
    + [(4096, H, K, "causal") for H, K in ((64, 640), (128, 1152))]  # next to the T=131072 rows
    + [(32768, H, K, "distinct") for H, K in ((64, 640), (128, 1152))]
    + [(131072, H, K, "causal") for H, K in ((64, 640), (128, 1152))]
)
QUICK_SWEEP = ((4096, 64, 640, "distinct"), (4096, 64, 640, "causal"))
TORCH_ROWS_LIMIT = 8 * 2**30  # plain PyTorch gathers T*K*D*2 bytes of rows (and more)

FORWARD_KERNELS = ("gluon_sm90", "triton")
MODES = (("fast", False), ("deterministic", True))
GIB = 2**30
# do_bench takes about rep / (a call's ms) samples: a call that would get fewer than
# MIN_SAMPLES is timed instead as the median of SLOW_CALLS calls by CUDA events, each after
# the same L2 flush as do_bench's (its rep would otherwise time a 50-100 ms call once)
MIN_SAMPLES = 5
SLOW_CALLS = 5
L2_FLUSH_BYTES = 256 * 2**20  # (triton.testing.do_bench's buffer)
TIMING = {  # (do_bench warmup ms, rep ms)
    "table": (50, 200),
    "sweep": (25, 100),
    "quick": (5, 20),
}


# --------------------------------------------------------------------------- helpers
def require_cuda(script: str) -> None:
    """Exit with a message (not a traceback) where there is no CUDA GPU."""
    if not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA GPU, and torch.cuda.is_available() is False here "
                 f"(torch {torch.__version__}). On the CPU the ops run the PyTorch reference; "
                 "`python -m dsv4_sparse_attn` shows which kernel runs what.")


def make_inputs(T, H, K, D, *, pool="random", n_pool=None, seed=0, dev="cuda"):
    """q, kv, idx, sink (seed ``seed``): T raw kv rows, then a pool of ``n_pool`` (T/4) rows;
    ids from ``testing.deepseek_indices`` with ``pool``."""
    torch.manual_seed(seed)
    n_pool = T // 4 if n_pool is None else n_pool
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(T + n_pool, D, device=dev, dtype=torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(seed)
    idx = testing.deepseek_indices(T, K, n_pool=n_pool, pool=pool, device=dev, generator=g)
    sink = torch.randn(H, device=dev)
    return q, kv, idx, sink


def flops(T, H, K, D, d_v=None):
    """(forward, backward) FLOPs: 2*T*H*K*(D + d_v) and 2*T*H*K*(3*D + 2*d_v), which are
    4*T*H*K*D and 10*T*H*K*D when d_v = D (the scores over D columns, the values over d_v)."""
    d_v = D if d_v is None else d_v
    return 2 * T * H * K * (D + d_v), 2 * T * H * K * (3 * D + 2 * d_v)


def backward_inputs(T, H, K, D, dev="cuda", **kw):
    """``make_inputs`` plus what a backward takes: the forward's out and lse (the default
    kernel, scale D**-0.5) and random grad_out and grad_lse.

    Returns q, kv, idx, sink, out, lse, do, dl.
    """
    q, kv, idx, sink = make_inputs(T, H, K, D, dev=dev, **kw)
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5)
    do, dl = torch.randn_like(out), torch.randn_like(lse)
    return q, kv, idx, sink, out, lse, do, dl


def torch_sparse_mla(q, kv, idx, sink, scale, d_v=None):
    """Plain PyTorch: gather the rows, bf16 matmuls, fp32 softmax with the sink; values are
    the rows' first ``d_v`` columns (default all). Autograd-able.

    The gather is an embedding lookup with masked slots on a zero padding row: its backward
    sums repeated rows with a sort and skips the padding row. (``kv[ids]`` with masked slots
    sent to row 0 had its backward, ``index_put_`` with accumulate, add every masked slot
    into row 0 one after another: up to 19x slower with causal ids on an H100, 31x on an
    H200, a baseline no one would keep.)"""
    N = kv.shape[0]
    valid = (idx >= 0) & (idx < N)
    table = torch.cat([kv, kv.new_zeros(1, kv.shape[1])])
    rows = torch.nn.functional.embedding(torch.where(valid, idx, N).long(), table, padding_idx=N)  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q, rows).float() * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(torch.cat([s, sink[None, :, None].expand(s.shape[0], -1, 1)], -1), -1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("thk,tkd->thd", p.to(q.dtype), rows if d_v is None else rows[..., :d_v])
    return out, lse


def event_times(fn, calls, flush=None):
    """ms of each of ``calls`` calls of ``fn``, one after another, timed with CUDA events;
    ``flush`` (a tensor) is zeroed before each call, outside the timed region."""
    times = []
    for _ in range(calls):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench(fn, warmup=50, rep=200):
    """Median ms of a call of ``fn``: ``triton.testing.do_bench`` (warmup and rep in ms, L2
    flushed before each timed call); a call that do_bench would time fewer than MIN_SAMPLES
    times (slower than rep / MIN_SAMPLES) is timed with CUDA events instead: the median of
    SLOW_CALLS calls, the L2 flushed before each as do_bench does."""
    fn()  # warm-up: compilation, autotuning, the allocator
    torch.cuda.synchronize()
    first = event_times(fn, 1)[0]
    if first * MIN_SAMPLES < rep:
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return statistics.median(event_times(fn, SLOW_CALLS, l2_flush_buffer()))


def l2_flush_buffer():
    return torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


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


def measure(fn, flops, timing, keep=None):
    """{"ms", "tflops"} of ``fn``, and "extra_gib" when ``keep`` (its outputs) is given."""
    ms = bench(fn, *timing)
    r = {"ms": ms, "tflops": flops / ms * 1e-9}
    if keep is not None:
        r["extra_gib"] = peak_extra(fn, nbytes(*keep)) / GIB
    return r


@contextlib.contextmanager
def backward_mode(deterministic):
    """``set_deterministic_backward`` for a block, back to following torch after it."""
    dsv4_sparse_attn.set_deterministic_backward(deterministic)
    try:
        yield
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)


def kernel_name(direction, q, deterministic=True, d_v=None, has_len=False):
    """The kernel the dispatcher runs for this call now (under any ``use_kernels``)."""
    return dispatch.choose(direction, Call.of(q, deterministic, d_v=d_v or q.shape[-1], has_len=has_len))[0]


def rejection(direction, name, q, deterministic=True, d_v=None, has_len=False):
    """Why kernel ``name`` does not take this call, or None if it does."""
    try:
        with dsv4_sparse_attn.use_kernels(**{direction: name}):
            kernel_name(direction, q, deterministic, d_v, has_len)
    except ValueError as e:
        return str(e).split("does not take this call: ", 1)[-1]
    return None


def attempt(fn):
    """fn()'s result, or {"error": ...} (a forced kernel that fails to build, out of memory):
    one failure costs one figure, not the whole table."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        with contextlib.suppress(Exception):  # a CUDA error may be sticky: report it all the same
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        print(f"  error: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def cosine(a, b):
    a, b = a.detach().float().flatten(), b.detach().float().flatten()
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


# --------------------------------------------------------------------------- default table
def table_row(T, H, K, D, label, timing, with_torch=True, d_v=None):
    """``d_v``: values narrower than the keys (the 576/512 layout), else None."""
    q, kv, idx, sink = make_inputs(T, H, K, D)
    scale = D ** -0.5
    fl_f, fl_b = flops(T, H, K, D, d_v)
    row = dict(label=label, T=T, H=H, K=K, D=D, N=kv.shape[0])
    if d_v is not None:
        row["d_v"] = d_v

    fwd = lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale, None, d_v)  # noqa: E731
    out, lse = fwd()
    row["fwd"] = dict(kernel=kernel_name("forward", q, d_v=d_v),
                      **measure(fwd, fl_f, timing, keep=(out, lse)))
    row["fwd"]["gather_gbs"] = T * K * D * 2 / row["fwd"]["ms"] * 1e-6
    # Each forward kernel: forced where both take the call, else the default figure again.
    takes = {n: rejection("forward", n, q, d_v=d_v) for n in FORWARD_KERNELS}
    row["fwd_kernels"] = {}
    for name, reason in takes.items():
        if reason is not None:
            row["fwd_kernels"][name] = {"rejected": reason}
        elif all(r is None for r in takes.values()):
            with dsv4_sparse_attn.use_kernels(forward=name):
                row["fwd_kernels"][name] = dict(attempt(lambda: measure(fwd, fl_f, timing)), forced=True)
        else:
            row["fwd_kernels"][name] = dict(ms=row["fwd"]["ms"], tflops=row["fwd"]["tflops"], forced=False)

    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def bwd():
        return torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, scale, None, d_v)

    row["bwd"], row["bwd_triton"] = {}, {}
    for mode, det in MODES:
        with backward_mode(det):
            g = bwd()
            name = kernel_name("backward", q, det, d_v=d_v)
            row["bwd"][mode] = dict(kernel=name, **measure(bwd, fl_b, timing, keep=g))
            del g
            if name == "triton":
                row["bwd_triton"][mode] = dict(ms=row["bwd"][mode]["ms"], tflops=row["bwd"][mode]["tflops"],
                                               forced=False)
            elif rejection("backward", "triton", q, det, d_v=d_v) is None:
                with dsv4_sparse_attn.use_kernels(backward="triton"):
                    row["bwd_triton"][mode] = dict(attempt(lambda: measure(bwd, fl_b, timing)), forced=True)

    # One training step of the op through torch.ops.dsv4.sparse_mla (autograd), default mode.
    # q, kv and the sink stand for activations: their gradients are returned to the caller
    # (torch.autograd.grad), as a model's backward passes them on, not added into the
    # leaves' .grad (which would time a q-sized add per step: 0.06-0.36 ms at T = 4096).
    qg, kvg, sg = (x.detach().requires_grad_() for x in (q, kv, sink))

    def step_ours():
        o, lse_ = torch.ops.dsv4.sparse_mla(qg, kvg, idx, sg, scale, None, d_v)
        return torch.autograd.grad((o, lse_), (qg, kvg, sg), (do, dl))

    det = dsv4_sparse_attn.deterministic_backward()
    row["step"] = dict(ms=bench(step_ours, *timing), mode="deterministic" if det else "fast",
                       fwd_kernel=kernel_name("forward", q, d_v=d_v),
                       bwd_kernel=kernel_name("backward", q, det, d_v=d_v))
    if with_torch:
        tf = lambda: torch_sparse_mla(q, kv, idx, sink, scale, d_v)  # noqa: E731

        def step_torch():
            o, lse_ = torch_sparse_mla(qg, kvg, idx, sg, scale, d_v)
            return torch.autograd.grad((o, lse_), (qg, kvg, sg), (do, dl))

        def torch_figures():
            r = measure(tf, fl_f, timing, keep=(out, lse))
            r = {"fwd_ms": r["ms"], "fwd_tflops": r["tflops"], "fwd_extra_gib": r["extra_gib"]}
            r["step_ms"] = bench(step_torch, *timing)
            return r

        row["torch"] = attempt(torch_figures)
        if "step_ms" in row["torch"]:
            row["step_speedup"] = row["torch"]["step_ms"] / row["step"]["ms"]
    return row


# --------------------------------------------------------------------------- backward sweep
def load_cudnn(path):
    """cudnn_peer from ``path`` (its make_bwd), or None with the reason printed."""
    sys.path.insert(0, os.path.abspath(path))
    try:
        import cudnn_peer
        return cudnn_peer, None
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"cuDNN peer not loaded from {path}: {why}", file=sys.stderr, flush=True)
        return None, why


def sweep_row(T, H, K, ids, D, timing, peer=None, with_torch=True):
    n_pool = max(T // 4, K)
    q, kv, idx, sink = make_inputs(T, H, K, D, pool=ids, n_pool=n_pool)
    N, scale, fl_b = kv.shape[0], D ** -0.5, 10 * T * H * K * D
    row = dict(T=T, H=H, K=K, D=D, N=N, ids=ids,
               valid_slots=((idx >= 0) & (idx < N)).float().mean().item())
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale)
    do = torch.randn_like(out)
    bwd = lambda: torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale)  # noqa: E731
    ours = {}
    for mode, det in MODES:
        with backward_mode(det):
            g = bwd()
            ours[mode] = (g[1], g[2])  # grad_kv, grad_sink: for the cosine with cuDNN's
            row[mode] = dict(kernel=kernel_name("backward", q, det), **measure(bwd, fl_b, timing, keep=g))
            del g

    torch_fn = []  # (its graph kept for the second pass)
    if with_torch and T * K * D * 2 < TORCH_ROWS_LIMIT:
        def torch_bwd():
            qg, kvg, sg = (x.detach().requires_grad_() for x in (q, kv, sink))
            o, _ = torch_sparse_mla(qg, kvg, idx, sg, scale)
            f = lambda: torch.autograd.grad(o, (qg, kvg, sg), do, retain_graph=True)  # noqa: E731
            r = measure(f, fl_b, timing)
            torch_fn.append(f)
            return r
        row["torch"] = attempt(torch_bwd)
    else:
        why = f"T*K*D*2 bytes >= {TORCH_ROWS_LIMIT / GIB:g} GiB" if with_torch else "--no-torch"
        row["torch"] = {"skipped": why}

    peer_fn = []
    if peer is not None:
        def cudnn():
            f = peer.make_bwd(q, kv, idx, sink, scale, out, lse, do)
            dq, dkv, dsink = f()
            r = measure(f, fl_b, timing)
            # which of the kit's main kernels ran: one built for this (H, K) or the generic
            # length kernel (the adapter's choice; None where the adapter does not say)
            name_of = getattr(peer, "_main_name", None)
            r["kernel"] = name_of(H, K, False)[0] if callable(name_of) else None
            r["cos_dkv"] = {m: cosine(dkv, ours[m][0]) for m, _ in MODES}
            if dsink is not None:
                r["cos_dsink"] = {m: cosine(dsink, ours[m][1]) for m, _ in MODES}
            peer_fn.append(f)
            return r
        row["cudnn"] = attempt(cudnn)

    # A second pass in the reverse order, cuDNN first: an arm's place in a pass moved one
    # build's time by up to 5.6% (docs/performance/method.md#comparing-variants), and the
    # first pass times cuDNN last. Every arm keeps its better time; "ms_passes" has both.
    def again(name, fn):
        r = row[name]
        ms = bench(fn, *timing)
        r["ms_passes"] = [r["ms"], ms]
        r["ms"] = min(r["ms"], ms)
        r["tflops"] = fl_b / r["ms"] * 1e-9
    if peer_fn and "ms" in row["cudnn"]:
        again("cudnn", peer_fn[0])
    if torch_fn and "ms" in row["torch"]:
        again("torch", torch_fn.pop())
    for mode, det in reversed(MODES):
        with backward_mode(det):
            again(mode, bwd)

    sp = {}
    for mode, _ in MODES:
        for other in ("torch", "cudnn"):
            if "ms" in row.get(other, {}):
                sp[f"{mode}_vs_{other}"] = row[other]["ms"] / row[mode]["ms"]
    sp["deterministic_vs_fast"] = row["fast"]["ms"] / row["deterministic"]["ms"]
    row["speedups"] = sp  # other's time / ours: > 1 where ours is faster
    return row


# --------------------------------------------------------------------------- results
def git_commit():
    """(short commit, dirty?) of the checkout; BENCH_COMMIT names it where the checkout has
    no history of its own (a copied working tree, as on a lent GPU machine)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"], False
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                           timeout=10)
        if r.returncode != 0:
            return "unknown", None
        d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip(), (bool(d.stdout.strip()) if d.returncode == 0 else None)
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def source_digest(root=None):
    """sha256 of the package's source (every .py under src/dsv4_sparse_attn, by relative
    path): the code a run measured, also where the commit label it was given is stale.
    ``python benchmarks/bench.py --source-digest`` prints it for a checkout, to compare."""
    root = root or os.path.join(os.path.dirname(HERE), "src", "dsv4_sparse_attn")
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):  # (by directory: the order does not depend on the walk)
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read() + b"\0")
    return h.hexdigest()


def slug(s):
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def document(kind, settings, quick):
    """The JSON envelope: when, where, with what (rows are added as they are measured)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    commit, dirty = git_commit()
    return {
        "schema": 1,
        "kind": kind,
        "quick": quick,
        "complete": False,
        "date": now.date().isoformat(),
        "timestamp": now.isoformat(timespec="seconds"),
        "commit": commit,
        "commit_dirty": dirty,
        "source_sha256": source_digest(),
        "gpu": {"name": props.name, "sm_count": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / GIB},
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "python": platform.python_version(), "dsv4_sparse_attn": dsv4_sparse_attn.__version__,
                     "cuda": torch.version.cuda},
        "command": shlex.join([os.path.basename(sys.executable)] + sys.argv),
        "settings": settings,
        "rows": [],
    }


def default_json_path(doc):
    name = f"{doc['date']}_{slug(doc['gpu']['name'])}_triton{doc['versions']['triton']}"
    name += "_bwd-sweep" if doc["kind"] == "backward_sweep" else ""
    name += "_quick" if doc["quick"] else ""
    return os.path.join(RESULTS_DIR, name + ".json")


def write(doc, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Benchmark of dsv4 sparse MLA on one CUDA GPU (the default table, or the backward "
                    "side by side with --backward-sweep); JSON results for benchmarks/report.py.")
    ap.add_argument("--backward-sweep", action="store_true",
                    help="the backward side by side (T up to 131072, both modes, plain PyTorch, cuDNN)")
    ap.add_argument("--cudnn", metavar="DIR", help="with --backward-sweep: time cuDNN's backward "
                    "(DIR/cudnn_peer.py, make_bwd)")
    ap.add_argument("--shapes", default="all",
                    help="'all', or comma-separated rows of the default table by number (0-6) or label; "
                         "the sweep keeps the rows with those (H, K)")
    ap.add_argument("--T", default=None,
                    help="comma-separated T (table default 4096; the sweep keeps the rows with these T)")
    ap.add_argument("--D", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="a reduced set with short timings, for smoke runs")
    ap.add_argument("--source-digest", action="store_true",
                    help="print the package source's sha256 (what results record as source_sha256) and exit")
    ap.add_argument("--no-torch", action="store_true", help="leave out plain PyTorch")
    ap.add_argument("--no-v32", action="store_true",
                    help="leave out the 576/512 rows of the default table (also left out with --quick "
                         "and --shapes)")
    ap.add_argument("--json", metavar="PATH", help="results JSON (default: benchmarks/results/"
                    "<date>_<gpu>_triton<version>[_bwd-sweep][_quick].json)")
    ap.add_argument("--out", metavar="PATH", help="also write the Markdown table here")
    a = ap.parse_args(argv)
    if a.cudnn and not a.backward_sweep:
        ap.error("--cudnn goes with --backward-sweep")
    if a.shapes == "all":
        a.shape_rows = list(range(len(SHAPES))) if not a.quick else list(QUICK_SHAPES)
    else:
        labels = {s[2].lower(): i for i, s in enumerate(SHAPES)}
        a.shape_rows = []
        for tok in a.shapes.split(","):
            tok = tok.strip()
            if tok.isdigit() and int(tok) < len(SHAPES):
                a.shape_rows.append(int(tok))
            elif tok.lower() in labels:
                a.shape_rows.append(labels[tok.lower()])
            else:
                ap.error(f"--shapes: no row {tok!r} (0-{len(SHAPES) - 1} or one of "
                         f"{', '.join(s[2] for s in SHAPES)})")
    try:
        a.Ts = [int(t) for t in a.T.split(",")] if a.T else None
    except ValueError:
        ap.error(f"--T takes comma-separated integers, got {a.T!r}")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.source_digest:
        print(source_digest())
        return
    require_cuda("bench.py")
    sys.path.insert(0, HERE)
    import report  # the tables (benchmarks/report.py: the standard library only)

    timing = TIMING["quick" if a.quick else "sweep" if a.backward_sweep else "table"]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    if a.backward_sweep:
        hk = {(SHAPES[i][0], SHAPES[i][1]) for i in a.shape_rows}
        rows = [r for r in (QUICK_SWEEP if a.quick else SWEEP)
                if (r[1], r[2]) in hk and (a.Ts is None or r[0] in a.Ts)]
        peer, peer_error = load_cudnn(a.cudnn) if a.cudnn else (None, None)
        settings = {"D": a.D, "dtype": "bfloat16", "sink": True, "seed": 0, "grad_lse": None,
                    "ids": "testing.deepseek_indices(window=128, n_pool=max(T//4, K), pool=ids)",
                    "timing_ms": {"warmup": timing[0], "rep": timing[1], "min_samples": MIN_SAMPLES,
                                  "slow_calls": SLOW_CALLS},
                    "torch_rows_limit_gib": TORCH_ROWS_LIMIT / GIB,
                    "cudnn": a.cudnn, "cudnn_error": peer_error,
                    # the kit's build (the frontend release and compiler it was built from)
                    "cudnn_build": getattr(peer, "MANIFEST", {}).get("source") if peer else None}
        doc = document("backward_sweep", settings, a.quick)
    else:
        rows = [(T, *SHAPES[i], a.D, None) for T in (a.Ts or [4096]) for i in a.shape_rows]
        if not (a.no_v32 or a.quick or a.shapes != "all"):
            rows += [(T, H, K, label, V32_D, V32_DV) for T in (a.Ts or [4096]) for H, K, label in V32_SHAPES]
        settings = {"D": a.D, "dtype": "bfloat16", "sink": True, "seed": 0,
                    "ids": "testing.deepseek_indices(window=128, n_pool=T//4, pool='random')",
                    "timing_ms": {"warmup": timing[0], "rep": timing[1], "min_samples": MIN_SAMPLES,
                                  "slow_calls": SLOW_CALLS}}
        doc = document("table", settings, a.quick)
    path = a.json or default_json_path(doc)

    for r in rows:
        if a.backward_sweep:
            T, H, K, ids = r
            print(f"T={T} H={H} K={K} ids={ids}", flush=True)
            try:
                row = sweep_row(T, H, K, ids, a.D, timing, peer, with_torch=not a.no_torch)
            except torch.OutOfMemoryError as e:  # (T = 131072 at H = 128 needs more than 80 GB)
                gib = torch.cuda.get_device_properties(0).total_memory / GIB
                why = f"out of memory on this {gib:.0f} GiB GPU: {str(e).splitlines()[0][:120]}"
                print(why, flush=True)
                row = dict(T=T, H=H, K=K, D=a.D, ids=ids, fast={"error": why}, deterministic={"error": why},
                           torch={"skipped": why})
        else:
            T, H, K, label, D, d_v = r
            print(f"{label}: T={T} H={H} K={K} D={D}" + (f" d_v={d_v}" if d_v else ""), flush=True)
            row = table_row(T, H, K, D, label, timing, with_torch=not a.no_torch, d_v=d_v)
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
        write(doc, path)
        torch.cuda.empty_cache()
    doc["complete"] = True
    report.validate(doc)
    write(doc, path)
    text = report.tables(doc)
    print("\n" + text)
    print(f"\nwrote {path}")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
