"""With topk_length: the backward's tokens taken longest first (``backward.length_order``,
shipped) against token order (the order before it), in one process, each arm twice (the
second time in the other order).

    PYTHONPATH=src:benchmarks python benchmarks/experiments/chunk_order_bench.py

Inputs as features_bench.py's "lengths" rows (T = 4096, lengths uniform in [128, K],
DeepSeek ids, a sink), at D = 512 and at 576/512 for K = 2048. Per arm: the fast and the
deterministic backward (``torch.ops.dsv4.sparse_mla_bwd``, bench.py's timing), the GPU
time of one deterministic call's kernels (torch.profiler), the
deterministic gradients bitwise equal over two calls, and grad_kv's largest difference
between the arms (the fold's order differs, so the last bits may) over its largest value.
The full-K deterministic time is printed beside them (the ratio of issue #16's item 2),
and the host's time to enqueue a deterministic call. ``PROFILE_HOST=1``: cProfile of ten
deterministic calls at H64 K2048 (shipped order).
"""
import cProfile
import json
import os
import pstats
import time

import torch

import features_bench as F
from dsv4_sparse_attn.kernels import backward

shipped = backward.length_order


def token_order(topk_length, K):
    return torch.arange(topk_length.shape[0], device=topk_length.device, dtype=torch.int32)


def bench(fn):
    return F.bench(fn, 25, 200)  # (a warm-up call first, then do_bench's median)


def host_ms(fn, calls=10):
    """The host's time to enqueue one call (the GPU idle before it, no sync inside): where
    it exceeds the kernels' time, the call waits on its chunks' launches."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return host


def host_profile(fn, calls=10):
    """cProfile of ``calls`` calls of ``fn`` (after one to warm up, the GPU idle before
    them) and the host's ms a call under the profiler."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    ms = (time.perf_counter() - t) / calls * 1e3
    torch.cuda.synchronize()
    return pstats.Stats(prof), ms


def lengths_case(T, H, K, D=512, d_v=None):
    """features_bench's inputs with per-token lengths uniform in [128, K] (seeded), the
    forward's out and lse, random dO and dlse: the lengths and ``bwd(lengths=the lengths)``,
    one ``torch.ops.dsv4.sparse_mla_bwd`` call (``bwd(None)``: full K)."""
    q, kv, idx, sink = F.inputs(T, H, K, D)
    g = torch.Generator(device="cuda").manual_seed(1)
    length = torch.randint(128, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
    out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length, d_v)
    do, dl = torch.randn_like(out), torch.randn_like(lse)

    def bwd(lengths=length):
        return torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, None, lengths, d_v)
    return length, bwd


def alternating(arms, rounds):
    """(round, arm) for ``rounds`` rounds of ``arms``, every second round in the other order."""
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            yield r, arm


def emit(row, digits=4):
    print(json.dumps({k: round(v, digits) if isinstance(v, float) else v for k, v in row.items()}),
          flush=True)


def kernel_ms(fn):
    """The GPU time of one call's kernels (torch.profiler): next to the wall time, whether
    the call waits on the host (its chunks' launches) rather than on the GPU."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def main():
    for name, H, K in (("d512", 64, 640), ("d512", 128, 1152), ("d512", 64, 2048), ("v32", 64, 2048)):
        D = 576 if name == "v32" else 512
        _, bwd = lengths_case(4096, H, K, D, 512 if name == "v32" else None)

        with F.backward_mode(True):
            full_det = bench(lambda: bwd(None))
        grads = {}
        arms = (("length", shipped), ("token", token_order))
        for rep, (arm, fn) in alternating(arms, 2):
            backward.length_order = fn
            row = dict(layout=name, H=H, K=K, rep=rep, arm=arm, full_det_ms=full_det)
            for mode, det in (("fast", False), ("det", True)):
                with F.backward_mode(det):
                    row[f"{mode}_ms"] = bench(bwd)
            with F.backward_mode(True):
                row["det_kernels_ms"] = kernel_ms(bwd)
                row["det_host_ms"] = host_ms(bwd)
                a, b = bwd(), bwd()
            row["det_bitwise"] = all(torch.equal(x, y) for x, y in zip(a, b))
            grads[arm] = a
            row["det_ratio"] = row["det_ms"] / full_det
            if len(grads) == 2:
                dkv = (grads["length"][1].float() - grads["token"][1].float()).abs().max()
                row["dkv_diff_rel"] = (dkv / grads["token"][1].float().abs().max()).item()
            emit(row, 5)
        backward.length_order = shipped
        if os.environ.get("PROFILE_HOST") and name == "d512" and K == 2048:
            # where the host's time per call goes (the deterministic mode, 32 chunks)
            with F.backward_mode(True):
                stats, _ = host_profile(bwd)
            stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
