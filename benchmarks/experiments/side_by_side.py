"""What the backward experiments share: cuDNN's side-by-side inputs (a causal window of 128
rows, then distinct pool ids; N = T + max(T/4, K)), drawn from one generator seeded per
shape, so that every script times the same tensors for the same (T, H, K, seed); the timing
they all use; and cuDNN's peer module from the kit's folder."""
import os
import sys

import torch
import triton


def ids(T, K, N, g, dev):
    """int32 [T, K]: the window t-127..t (-1 where negative), then K - 128 distinct pool rows."""
    t = torch.arange(T, device=dev)
    w = min(128, K)
    win = t[:, None] - torch.arange(w, device=dev)[None, :]
    win = torch.where(win >= 0, win, -1)
    pool = torch.argsort(torch.rand(T, N - T, device=dev, generator=g), dim=1)[:, :K - w] + T
    return torch.cat([win, pool], 1).int()


def inputs(T, H, K, D=512, d_v=None, seed=None, dev="cuda"):
    """q, kv, idx, sink, grad_out, out, lse (out and lse from the default forward, scale
    D ** -0.5); ``d_v``: values narrower than keys (the 576/512 layout); ``seed``: default
    T + H + K."""
    d_v = D if d_v is None else d_v
    g = torch.Generator(device=dev).manual_seed(T + H + K if seed is None else seed)
    N = T + max(T // 4, K)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    kv = torch.randn(N, D, device=dev, dtype=torch.bfloat16, generator=g)
    idx = ids(T, K, N, g, dev)
    sink = torch.linspace(-2, 2, H, device=dev)
    do = torch.randn(T, H, d_v, device=dev, dtype=torch.bfloat16, generator=g)
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, None, None if d_v == D else d_v)
    return q, kv, idx, sink, do, out, lse


def pool_inputs(T, H, K, pool, D=512, dev="cuda", d_v=None):
    """q, kv, idx, sink, grad_out, out, lse of the long-context L2 experiments
    (evict_last_bench.py, l2_persist_bench.py): ``testing.deepseek_indices`` with ``pool``
    ("distinct" or "causal") into max(T // 4, K) pool rows after the T raw rows, seed 0, a
    random sink; out and lse from the default forward, scale D ** -0.5 (``d_v``: values
    narrower than keys, as D = 576, d_v = 512)."""
    from dsv4_sparse_attn import testing

    torch.manual_seed(0)
    n_pool = max(T // 4, K)
    g = torch.Generator(device=dev).manual_seed(0)
    idx = testing.deepseek_indices(T, K, n_pool=n_pool, pool=pool, device=dev, generator=g)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(T + n_pool, D, device=dev, dtype=torch.bfloat16)
    sink = torch.randn(H, device=dev)
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, D ** -0.5, None, d_v)
    return q, kv, idx, sink, torch.randn_like(out), out, lse


def gluon_backward(q, kv, idx, sink, do, out, lse, scale):
    """``run(det, **kw)``: the backward on these tensors (no grad_lse) with the Gluon main
    kernel, ``kernels.backward.sparse_mla_bwd(..., main=backward_gluon, deterministic=det)``,
    ``kw`` going on to ``backward_gluon.launch``."""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_gluon

    def run(det, **kw):
        return kbwd.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale, main=backward_gluon,
                                   deterministic=det, **kw)
    return run


def with_flags(module, run, **flags):
    """``run`` with ``module``'s attributes ``flags`` set for the call and restored after it
    (a module-level option, e.g. ``forward_gluon.TRAILING_MASKED_SKIPPED``, as an arm)."""
    def call(*args, **kw):
        saved = {name: getattr(module, name) for name in flags}
        for name, value in flags.items():
            setattr(module, name, value)
        try:
            return run(*args, **kw)
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
    return call


def graphed(fn):
    """``fn``'s call captured in a CUDA graph (after two warm calls on a side stream), and the
    outputs that the graph's replays write."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fn()
    return g, outs


def env_shapes(default):
    """(T, H, K) triples from the environment's SHAPES ("T,H,K;T,H,K", to run fewer in a short
    call), else ``default``."""
    given = [tuple(int(v) for v in s.split(",")) for s in os.environ.get("SHAPES", "").split(";") if s]
    return given or default


def relerr(a, b):
    """||a - b|| / ||b|| in float64 (on the CPU: ``b`` may be the oracle's)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def in_order(topk_length, chunk, programs, n_hb):
    """``hopper.balanced_order``'s stand-in (patched into the Gluon launchers by the length
    experiments): every chunk's tokens in their order."""
    return torch.arange(topk_length.shape[0], device=topk_length.device, dtype=torch.int32) % chunk


def kernel_ms(run, names=("bwd_main",)):
    """(ms of the kernels whose names hold one of ``names``, ms of every other kernel) in one
    call of ``run`` under torch.profiler, after a warm one."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    main = other = 0.0
    for e in prof.key_averages():
        if any(n in e.key for n in names):
            main += e.device_time_total / 1e3
        else:
            other += e.device_time_total / 1e3
    return round(main, 4), round(other, 4)


def bench(fn):
    """Median ms of ``fn`` (``triton.testing.do_bench``, 5 warm-up calls, 40 ms of calls)."""
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def best_of_ab(fns, reps=2, timer=None):
    """{name: ms} for ``fns`` (name -> callable) timed in turn ``reps`` times, the better of
    each arm's times. The passes alternate in direction (A, B, C, then C, B, A, ...): the
    same build timed first and seventh in one pass measured up to 5% apart (the first
    faster; docs/performance/backward.md#defaults-by-triton-version-measured), so every
    arm gets an early and a late place, and drift across the run falls on every arm alike.
    (``timer``: ``bench`` unless given.)"""
    timer = bench if timer is None else timer
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(reps):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(timer(fns[name]))
    return {name: min(t) for name, t in times.items()}


def time_arms(r, fns, flops, peer=None):
    """Time ``fns`` (name -> callable) and ``peer`` (cuDNN's backward, when not None, as
    "cudnn") with ``best_of_ab`` and record each arm's ``{name}_ms`` and ``{name}_tflops``
    (``flops`` over its time) in ``r``."""
    if peer is not None:
        fns = {**fns, "cudnn": peer}
    for name, ms in best_of_ab(fns).items():
        r[f"{name}_ms"] = ms
        r[f"{name}_tflops"] = round(flops / ms / 1e9, 1)


def cudnn_peer(argv=None):
    """The peer kit's ``cudnn_peer`` module from the folder in ``argv[1]`` (default
    ``sys.argv``), or None (no folder given, or it does not load: said why)."""
    argv = sys.argv if argv is None else argv
    if len(argv) < 2:
        return None
    sys.path.insert(0, argv[1])
    try:
        import cudnn_peer as peer
    except Exception as e:  # noqa: BLE001
        print("no cudnn peer:", e)
        return None
    return peer


def peer_bwd(peer, r, q, kv, idx, sink, scale, out, lse, do):
    """cuDNN's backward on these tensors as a callable, run once; None (the reason in
    ``r["cudnn_error"]``) when there is no peer or it does not run them."""
    if peer is None:
        return None
    try:
        fn = peer.make_bwd(q, kv, idx, sink, scale, out, lse, do)
        fn()
        return fn
    except Exception as e:  # noqa: BLE001
        r["cudnn_error"] = str(e)[:200]
        return None
