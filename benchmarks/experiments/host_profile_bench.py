"""Where the host's time goes in one deterministic backward call of many chunks (H64
K2048, T = 4096: 32 chunks of 132 tokens), with and without per-token lengths: the host's
time to enqueue a call (ten calls back to back, the GPU idle before them), the kernels'
GPU time (torch.profiler), and cProfile's top functions over ten calls.

    PYTHONPATH=src:benchmarks:benchmarks/experiments python benchmarks/experiments/host_profile_bench.py
"""
import io

import features_bench as F
from chunk_order_bench import emit, host_ms, host_profile, kernel_ms, lengths_case


def main():
    length, case = lengths_case(4096, 64, 2048)
    for arm, lengths in (("lengths", length), ("full", None)):
        def bwd():
            return case(lengths)
        with F.backward_mode(True):
            row = dict(arm=arm, wall_ms=F.bench(bwd, 25, 200), kernels_ms=kernel_ms(bwd),
                       host_ms=host_ms(bwd))
            stats, row["host_ms_profiled"] = host_profile(bwd)
        emit(row)
        s = io.StringIO()
        stats.stream = s
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    main()
