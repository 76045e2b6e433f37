"""The Gluon main kernel's launch with its per-call cache (``backward_gluon.LAUNCH_CACHE``:
TMA descriptors and the rope scratch made once a call) against without (once a chunk):
the host's time to enqueue one deterministic call (``chunk_order_bench.host_ms``), its
wall time and the gradients' bits, in one process, the arms alternating (three rounds).

    PYTHONPATH=src:benchmarks:benchmarks/experiments python benchmarks/experiments/launch_cache_bench.py
"""
import json

import torch

import features_bench as F
from chunk_order_bench import host_ms
from dsv4_sparse_attn.kernels import backward_gluon


def main():
    T = 4096
    for H, K, D, d_v in ((64, 2048, 512, None), (64, 2048, 576, 512), (64, 640, 512, None)):
        q, kv, idx, sink = F.inputs(T, H, K, D)
        g = torch.Generator(device="cuda").manual_seed(1)
        length = torch.randint(128, K + 1, (T,), device="cuda", generator=g, dtype=torch.int32)
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length, d_v)
        do, dl = torch.randn_like(out), torch.randn_like(lse)

        def bwd():
            return torch.ops.dsv4.sparse_mla_bwd(do, dl, q, kv, out, lse, idx, sink, None, length, d_v)
        ref = None
        for rep in range(3):
            for arm in (True, False) if rep % 2 == 0 else (False, True):
                backward_gluon.LAUNCH_CACHE = arm
                with F.backward_mode(True):
                    row = dict(H=H, K=K, D=D, rep=rep, cache=arm, host_ms=host_ms(bwd),
                               wall_ms=F.bench(bwd, 25, 200))
                    got = bwd()
                ref = got if ref is None else ref
                row["bitwise_same"] = all(torch.equal(a, b) for a, b in zip(ref, got))
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
        backward_gluon.LAUNCH_CACHE = True


if __name__ == "__main__":
    main()
