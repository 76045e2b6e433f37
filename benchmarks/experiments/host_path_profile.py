"""Where a call's host time goes: cProfile over calls of the forward and the fast and
deterministic backward ops (the GPU's work queued, not waited for, between calls).

    PYTHONPATH=src:benchmarks:benchmarks/experiments \
        python benchmarks/experiments/host_path_profile.py > profile.txt

(docs/performance/backward.md#the-fast-modes-floor-probed: about 1 ms of host time a fast
backward call at T = 4096, hidden by do_bench, near the GPU time at K = 160.)
"""
import cProfile
import io
import os
import pstats

import torch

import dsv4_sparse_attn
from host_gap_bench import case, host_us  # (this directory)

ROWS = [(4096, 64, 640), (4096, 64, 160), (4096, 128, 1152)]
ROWS = [ROWS[int(i)] for i in os.environ.get("PROFILE_ROWS", "0,1,2").split(",")]
CALLS = 40


def main():
    for T, H, K in ROWS:
        D = 512
        q, kv, idx, sink, scale, out, lse, do = case(T, H, K, D)
        fwd = lambda: torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, scale)  # noqa: E731
        bwd = lambda: torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale)  # noqa: E731
        for name, fn, det in (("forward", fwd, None), ("fast", bwd, False), ("deterministic", bwd, True)):
            dsv4_sparse_attn.set_deterministic_backward(det)
            try:
                fn()
                torch.cuda.synchronize()
                us = host_us(fn)
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(CALLS):
                    fn()
                pr.disable()
                torch.cuda.synchronize()
            finally:
                dsv4_sparse_attn.set_deterministic_backward(None)
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(25)
            st.sort_stats("cumulative").print_stats(45)
            print(f"===== T={T} H={H} K={K} {name}: host {us:.1f} us a call (median of 30); "
                  f"cProfile over {CALLS} calls below")
            print(s.getvalue(), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
