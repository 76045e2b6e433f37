"""The deterministic mode's chunks rounded down to whole waves of programs (shipped,
``backward.chunk_tokens`` with the SM count) against chunks as large as the partial-row
budget allows (no rounding): fewer chunks, so fewer launches for the host, against a last
wave that leaves SMs idle in every chunk. The bits do not depend on the chunking.

    PYTHONPATH=src:benchmarks:benchmarks/experiments python benchmarks/experiments/chunk_waves_bench.py

Per shape and arm (each twice, the second time in the other order): the call's wall time
(bench.py's timing), its kernels' GPU time (torch.profiler) and the host's time to enqueue
it; T = 4096, with per-token lengths uniform in [128, K] and without.
"""
import torch

import features_bench as F
from chunk_order_bench import alternating, emit, host_ms, kernel_ms, lengths_case
from dsv4_sparse_attn.kernels import backward

shipped = backward.chunk_tokens


def unrounded(T, n_hb, K, D, budget, n_sm=0):
    return shipped(T, n_hb, K, D, budget, 0)


def main():
    T = 4096
    for H, K in ((64, 2048), (64, 640), (128, 1152)):
        length, case = lengths_case(T, H, K)
        for lengths in (length, None):
            def bwd():
                return case(lengths)
            ref = None
            for rep, (arm, fn) in alternating((("waves", shipped), ("budget", unrounded)), 2):
                backward.chunk_tokens = fn
                with F.backward_mode(True):
                    # (one partial row a token and slot: H <= 64, or the head-block pairs)
                    chunk = fn(T, 1, K, 512, backward.PARTIAL_BYTES, 132)
                    row = dict(H=H, K=K, lengths=lengths is not None, arm=arm, rep=rep, chunk=chunk,
                               wall_ms=F.bench(bwd, 25, 200), kernels_ms=kernel_ms(bwd), host_ms=host_ms(bwd))
                    got = bwd()
                ref = got if ref is None else ref
                row["bitwise_same"] = all(torch.equal(a, b) for a, b in zip(ref, got))
                emit(row)
            backward.chunk_tokens = shipped


if __name__ == "__main__":
    main()
