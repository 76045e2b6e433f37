"""The Gluon main kernel's launch with its per-call cache (``backward_gluon.LAUNCH_CACHE``:
TMA descriptors and the rope scratch made once a call) against without (once a chunk):
the host's time to enqueue one deterministic call (``chunk_order_bench.host_ms``), its
wall time and the gradients' bits, in one process, the arms alternating (three rounds).

    PYTHONPATH=src:benchmarks:benchmarks/experiments python benchmarks/experiments/launch_cache_bench.py
"""
import torch

import features_bench as F
from chunk_order_bench import alternating, emit, host_ms, lengths_case
from dsv4_sparse_attn.kernels import backward_gluon


def main():
    for H, K, D, d_v in ((64, 2048, 512, None), (64, 2048, 576, 512), (64, 640, 512, None)):
        _, bwd = lengths_case(4096, H, K, D, d_v)
        ref = None
        for rep, arm in alternating((True, False), 3):
            backward_gluon.LAUNCH_CACHE = arm
            with F.backward_mode(True):
                row = dict(H=H, K=K, D=D, rep=rep, cache=arm, host_ms=host_ms(bwd),
                           wall_ms=F.bench(bwd, 25, 200))
                got = bwd()
            ref = got if ref is None else ref
            row["bitwise_same"] = all(torch.equal(a, b) for a, b in zip(ref, got))
            emit(row)
        backward_gluon.LAUNCH_CACHE = True


if __name__ == "__main__":
    main()
