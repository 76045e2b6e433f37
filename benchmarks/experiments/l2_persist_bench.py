"""The fast backward with part of its fp32 dKV accumulator (or of kv) in the L2's persisting
set-aside (an access-policy window on the stream for the main kernel's launch, through the
driver API), against the shipped launch, A, B, A, B in one process.

    PYTHONPATH=src:tests python benchmarks/experiments/l2_persist_bench.py > l2_persist.jsonl

Why: at T = 131072 with causal ids the accumulator's pool rows (32k rows, 64 MB) and kv's
(32 MB) are twice the L2, and the fast mode keeps 0.78 of its T = 4096 TFLOPS against the
issue's 0.9; ncu puts its misses above cuDNN's (reductions 15-18% against 11%;
docs/performance/backward.md#the-l2-at-long-contexts-next-to-cudnn-ncu), and neither L2
hint tried (evict-last on the reductions, kept; evict-first on q and dO after landing) made
up the gap. A reduction that misses costs a line read and a dirty line written back; a
gather that misses one read: so a persisting set-aside that holds accumulator lines first
should move fewer bytes through HBM than the LRU's even mix. At T = 32768 (distinct ids)
the pool's 8k rows (16 MB) fit beside the window's working set either way.

Prediction: 3-8% less time at T = 131072 H64 K640 causal with the pool accumulator
persisting (hit ratio the set-aside over the window's bytes), less or none with kv's pool
persisting instead, nothing at T = 4096 (everything fits) or T = 32768.

Arms (fast mode, Gluon main kernel): ``plain`` (shipped: evict-last reductions where the
accumulator outgrows the L2), ``acc_pool`` (window over the accumulator's pool rows
[T, N), hit ratio the set-aside over the window), ``acc_head`` (window over the pool's
first rows, as many as the set-aside holds, hit ratio 1), ``acc_all`` (window over the
whole accumulator, up to the largest window), ``limit_only`` (the set-aside reserved, no
window), ``shipped`` (``backward.persist_rows``'s window, the epilogue's window giving the
lines back; its rule at 4x the L2 where the module leaves it off). The first run (31f5563,
H100) also had ``acc_pool_no_evict`` (the reductions without evict-last: +18% at
T = 131072) and ``kv_pool`` (window over kv's pool rows: -4% at T = 131072, +50% at
T = 32768). grad_kv of each arm against ``plain``'s (fp32 atomics:
equal up to the order of the adds).
"""
import contextlib
import ctypes
import json
import os

import torch
import triton

import dsv4_sparse_attn  # noqa: F401
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon, l2_policy
from side_by_side import pool_inputs, relerr

dev, D = "cuda", 512
ROWS = [(4096, 64, 640, "distinct"), (32768, 64, 640, "distinct"), (131072, 64, 640, "causal"),
        (32768, 128, 1152, "distinct"), (131072, 128, 1152, "causal"), (65536, 64, 640, "causal")]
# L2P_ROWS="2,0": rows of ROWS (default 2,1,4); L2P_REPS: A, B passes (default 2)
ROWS = [ROWS[int(i)] for i in os.environ.get("L2P_ROWS", "2,1,4").split(",")]
REPS = int(os.environ.get("L2P_REPS", "2"))

_cu = ctypes.CDLL("libcuda.so.1")
CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
# (the rest of the driver's constants and the window's structures: l2_policy's)
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = l2_policy._LIMIT_PERSISTING_L2_CACHE_SIZE


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def _attr(a):
    v = ctypes.c_int()
    _check(_cu.cuDeviceGetAttribute(ctypes.byref(v), a, torch.cuda.current_device()), f"attribute {a}")
    return v.value


def set_window(stream, ptr=0, nbytes=0, hit_ratio=0.0):
    v = l2_policy._AttrValue()
    w = v.accessPolicyWindow
    w.base_ptr, w.num_bytes, w.hitRatio = ptr, nbytes, hit_ratio
    w.hitProp = l2_policy._PERSISTING if nbytes else l2_policy._NORMAL
    w.missProp = l2_policy._NORMAL
    _check(_cu.cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream),
                                    l2_policy._STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(v)),
           "cuStreamSetAttribute")


L2 = _attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
MAX_PERSIST = _attr(l2_policy._ATTR_MAX_PERSISTING_L2_CACHE_SIZE)
MAX_WINDOW = _attr(l2_policy._ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE)
print(json.dumps(dict(gpu=torch.cuda.get_device_name(), l2=L2, max_persist=MAX_PERSIST,
                      max_window=MAX_WINDOW)), flush=True)

_launch = backward_gluon.launch
_target = {}  # what the wrapped launch puts in the window: "acc" or "kv" (pool rows from T_POOL)


def _windowed_launch(q, kv, indices, grad_out, lse, delta, grad_q, acc, *rest, **kw):
    stream = torch.cuda.current_stream()
    t = _target.get("what")
    if t and t != "limit":
        what, part = t.split("_")
        x = acc if what == "acc" else kv
        row0 = q.shape[0] if part != "all" else 0  # (the pool rows follow the T raw rows)
        ptr = x.data_ptr() + row0 * x.stride(0) * x.element_size()
        nbytes = min(MAX_WINDOW, (x.shape[0] - row0) * x.stride(0) * x.element_size())
        if part == "head":  # the pool's first rows (causal ids: the most selected), all persisting
            nbytes = min(nbytes, MAX_PERSIST)
        set_window(stream, ptr, nbytes, min(1.0, MAX_PERSIST / nbytes))
    try:
        return _launch(q, kv, indices, grad_out, lse, delta, grad_q, acc, *rest, **kw)
    finally:
        if t and t != "limit":
            set_window(stream)  # (the launch has its attributes: later launches get none)


SHIPPED_MIN_L2 = 4 if kbwd.L2_PERSIST_MIN_L2 is None else kbwd.L2_PERSIST_MIN_L2


@contextlib.contextmanager
def arm(what):
    # (the shipped rule, ``backward.persist_rows``, only in the "shipped" arm, which reserves
    # the set-aside itself: ``l2_policy`` forgets it has, since each arm gives it back)
    shipped = what == "shipped"
    kbwd.L2_PERSIST_MIN_L2 = SHIPPED_MIN_L2 if shipped else float("inf")
    l2_policy._limits.clear()
    what = None if shipped else what
    _target["what"] = what
    if what:
        limit = ctypes.c_size_t(MAX_PERSIST)
        _check(_cu.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, limit), "cuCtxSetLimit")
    try:
        yield
    finally:
        _target.clear()
        if what or shipped:
            torch.cuda.synchronize()
            _check(_cu.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")
            _check(_cu.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(0)), "limit 0")


backward_gluon.launch = _windowed_launch
stream = torch.cuda.Stream()  # (a stream of our own: the legacy default stream takes no attributes)
ARMS = [("plain", None, None), ("acc_pool", "acc_pool", None), ("acc_head", "acc_head", None),
        ("acc_all", "acc_all", None), ("limit_only", "limit", None), ("shipped", "shipped", None)]
with torch.cuda.stream(stream):
    for T, H, K, ids in ROWS:
        q, kv, idx, sink, do, out, lse = pool_inputs(T, H, K, ids)

        def run(ev):
            return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, D ** -0.5,
                                       main=backward_gluon, deterministic=False, evict_last=ev)

        r = dict(T=T, H=H, K=K, ids=ids, acc_pool_mb=round((kv.shape[0] - T) * D * 4 / 2**20, 1))
        ref = run(None)[1].float()
        for name, what, ev in ARMS[1:]:
            with arm(what):
                r[f"{name}_err_dkv"] = relerr(run(ev)[1].float(), ref)
        ref = None
        fl = 10 * T * H * K * D
        for rep in range(REPS):
            for name, what, ev in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                with arm(what):
                    ms = triton.testing.do_bench(lambda: run(ev), warmup=3 if T <= 32768 else 1,
                                                 rep=60 if T <= 32768 else 700, return_mode="median")
                r[f"{name}_ms_{rep}"] = round(ms, 4)
                r[f"{name}_tflops_{rep}"] = round(fl / ms * 1e-9, 1)
        print(json.dumps(r), flush=True)
        q = kv = idx = out = lse = do = None
        torch.cuda.empty_cache()
