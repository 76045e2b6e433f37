#!/usr/bin/env python
"""Run ``torch.library.opcheck`` on the three ``dsv4`` ops over a matrix of sample inputs.

    python opcheck/run_opcheck.py                  # CPU samples, and CUDA ones if a GPU is there
    python opcheck/run_opcheck.py --device cpu -k bf16 -v

Prints one line per failure and a summary line ``N passed, M failed``; exits non-zero if
anything failed. Importable: ``samples(device)`` returns the sample list and
``run_sample(sample)`` checks one (tests/test_opcheck.py runs the CPU samples under pytest).

The matrix: sparse_mla and sparse_mla_fwd with and without sink, with and without
requires_grad on q / kv / sink; sparse_mla_bwd (inputs never require grad: its autograd
raises for double backward by design) with grad_lse None or given; dtypes float32,
bfloat16 and float16; several shapes (K not a power of two, H = 1, K = 1, kv as [N, 1, D]);
int32 and int64 indices (with masked, out-of-range and duplicated ids); scale None or given;
topk_length (values past K and negative) and d_v < D on all three ops.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

import dsv4_sparse_attn  # noqa: F401  (registers torch.ops.dsv4.*)

TEST_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (T, H, D, N, K): K not a power of two in most; H = 1; K = 1; N < K
SHAPES = (
    (5, 3, 16, 9, 6),
    (4, 1, 32, 6, 3),
    (3, 4, 8, 4, 7),
    (6, 2, 16, 11, 1),
    (4, 3, 64, 10, 5),  # a head dim the Triton kernels take: on CUDA this runs them
)


@dataclass
class Sample:
    name: str
    op: str  # "sparse_mla" | "sparse_mla_fwd" | "sparse_mla_bwd"
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any] = field(default_factory=dict)

    @property
    def opoverload(self):
        return getattr(torch.ops.dsv4, self.op).default


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _indices(T: int, K: int, N: int, idx_dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, N, (T, K), generator=gen, dtype=torch.int64)
    big = 2**31 - 1 if idx_dtype == torch.int32 else 2**40
    if T >= 1 and K >= 3:
        idx[0, 1] = idx[0, 0]  # duplicate
        idx[0, 2] = -1  # masked
    if T >= 2 and K >= 2:
        idx[1, -1] = N  # just past the end
        idx[1, 0] = big  # far out of range
    if T >= 3 and K >= 2:
        idx[2, -1] = -(2**31) if idx_dtype == torch.int32 else -(2**40)
    return idx.to(idx_dtype)


def _forward_inputs(shape, dtype, sink, idx_dtype, kv3d, device, gen):
    T, H, D, N, K = shape
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    kv = torch.randn(N, D, generator=gen).to(dtype)
    if kv3d:
        kv = kv[:, None]
    idx = _indices(T, K, N, idx_dtype, gen)
    s = torch.randn(H, generator=gen) if sink else None
    return [None if x is None else x.to(device) for x in (q, kv, idx, s)]


def _cycled_axes(i: int, kv3d_every: int):
    """Axes the sample matrix cycles through rather than crosses: shape, index dtype,
    scale, 3-d kv; and the part of the sample name that spells them."""
    shape = SHAPES[i % len(SHAPES)]
    idx_dtype = (torch.int32, torch.int64)[i % 2]
    scale = (None, 0.3)[(i // 2) % 2]
    kv3d = i % kv3d_every == 0
    axes = (f"T{shape[0]}H{shape[1]}D{shape[2]}N{shape[3]}K{shape[4]}-{_dtype_name(idx_dtype)}"
            f"-scale{scale}{'-kv3d' if kv3d else ''}")
    return shape, idx_dtype, scale, kv3d, axes


def samples(device: str = "cpu") -> List[Sample]:
    """The sample matrix on ``device`` (fresh tensors each call, seeded per sample name)."""
    out: List[Sample] = []
    cycle = itertools.count()

    def gen_for(name: str) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(name.encode()))

    # forward ops: op x dtype x sink x requires_grad, other axes cycled
    for op, dtype, sink, rg in itertools.product(
        ("sparse_mla", "sparse_mla_fwd"), DTYPES, (True, False), (True, False)
    ):
        shape, idx_dtype, scale, kv3d, axes = _cycled_axes(next(cycle), kv3d_every=5)
        name = f"{op}-{_dtype_name(dtype)}-sink{int(sink)}-grad{int(rg)}-{axes}"
        q, kv, idx, s = _forward_inputs(shape, dtype, sink, idx_dtype, kv3d, device, gen_for(name))
        if rg:
            for x in (q, kv, s):
                if x is not None:
                    x.requires_grad_(True)
        out.append(Sample(name, op, (q, kv, idx, s, scale)))

    # edge cases of the forward: an empty row with a sink (lse = sink), K = 0, T = 0
    for op, case in itertools.product(("sparse_mla", "sparse_mla_fwd"), ("emptyrow", "K0", "T0")):
        name = f"{op}-float32-{case}"
        gen = gen_for(name)
        shape = {"emptyrow": (4, 2, 8, 5, 3), "K0": (3, 2, 8, 4, 0), "T0": (0, 2, 8, 4, 3)}[case]
        q, kv, idx, s = _forward_inputs(shape, torch.float32, True, torch.int64, False, device, gen)
        if case == "emptyrow":
            idx[1] = -1
        for x in (q, kv, s):
            x.requires_grad_(True)
        out.append(Sample(name, op, (q, kv, idx, s, None)))

    # backward op: dtype x sink x grad_lse, other axes cycled; nothing requires grad
    for dtype, sink, with_dlse in itertools.product(DTYPES, (True, False), (True, False)):
        shape, idx_dtype, scale, kv3d, axes = _cycled_axes(next(cycle), kv3d_every=3)
        name = f"sparse_mla_bwd-{_dtype_name(dtype)}-sink{int(sink)}-dlse{int(with_dlse)}-{axes}"
        gen = gen_for(name)
        q, kv, idx, s = _forward_inputs(shape, dtype, sink, idx_dtype, kv3d, device, gen)
        o, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, s, scale)
        do = torch.randn(o.shape, generator=gen).to(dtype).to(device)
        dlse = torch.randn(lse.shape, generator=gen).to(device) if with_dlse else None
        out.append(Sample(name, "sparse_mla_bwd", (do, dlse, q, kv, o, lse, idx, s, scale)))

    # per-token lengths (some past K, some negative) and values narrower than keys (d_v < D)
    for op, dtype, (with_len, d_v) in itertools.product(
        ("sparse_mla", "sparse_mla_fwd", "sparse_mla_bwd"), (torch.float32, torch.bfloat16),
        ((True, None), (False, 12), (True, 12)),
    ):
        name = f"{op}-{_dtype_name(dtype)}-len{int(with_len)}-dv{d_v}"
        gen = gen_for(name)
        T, K = 5, 6
        q, kv, idx, s = _forward_inputs((T, 3, 16, 9, K), dtype, True, torch.int32, False, device, gen)
        length = torch.tensor([0, 3, K, K + 4, -1], dtype=torch.int32, device=device) if with_len else None
        if op == "sparse_mla_bwd":
            o, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, s, None, length, d_v)
            do = torch.randn(o.shape, generator=gen).to(dtype).to(device)
            dlse = torch.randn(lse.shape, generator=gen).to(device)
            out.append(Sample(name, op, (do, dlse, q, kv, o, lse, idx, s, None, length, d_v)))
        else:
            for x in (q, kv, s):
                x.requires_grad_(True)
            out.append(Sample(name, op, (q, kv, idx, s, None, length, d_v)))
    return out


def run_sample(sample: Sample, test_utils=TEST_UTILS) -> Dict[str, str]:
    """opcheck one sample; returns {test_util: "SUCCESS" | error text}; raises nothing."""
    try:
        result = torch.library.opcheck(
            sample.opoverload, sample.args, sample.kwargs, test_utils=test_utils, raise_exception=False
        )
    except Exception as e:  # noqa: BLE001  (opcheck itself failed: report, don't crash)
        return {"opcheck": f"{type(e).__name__}: {e}"}
    return {k: str(v) for k, v in result.items()}


def failures(result: Dict[str, str]) -> Dict[str, str]:
    return {k: v for k, v in result.items() if v != "SUCCESS"}


def devices(requested: str) -> List[str]:
    if requested == "all":
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("run_opcheck: --device cuda asked for, but torch.cuda.is_available() is False")
    return [requested]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("all", "cpu", "cuda"), default="all",
                    help="all (default): cpu, and cuda when available")
    ap.add_argument("-k", dest="keyword", default="", help="only samples whose name contains this")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every sample")
    args = ap.parse_args(argv)

    passed = failed = 0
    for dev in devices(args.device):
        for sample in samples(dev):
            name = f"{dev}:{sample.name}"
            if args.keyword and args.keyword not in name:
                continue
            bad = failures(run_sample(sample))
            if bad:
                failed += 1
                print(f"FAIL {name}")
                for util, err in bad.items():
                    print(f"    {util}: {err.strip().splitlines()[-1] if err.strip() else err}")
                if args.verbose:
                    for util, err in bad.items():
                        print(f"---- {util}\n{err}")
            else:
                passed += 1
                if args.verbose:
                    print(f"ok   {name}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(2)
