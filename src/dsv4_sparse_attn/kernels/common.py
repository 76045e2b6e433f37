"""What the Triton kernels and their launchers share: the description of a call that
kernels are chosen by, what plain Triton takes, interpreter switch, one-time warnings,
row loads."""
from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

LOG2E = 1.4426950408889634

# Head dims the Triton kernels are written and tuned for (split into two D/2 halves).
SUPPORTED_D = (64, 128, 256, 512)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def interpreting(device: torch.device) -> bool:
    """True when the kernels run under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors).

    CPU tensors reach the launchers only from the interpreter tests (the CPU op runs
    the reference): that is how CI, which has no GPU, exercises the Triton code.
    """
    return device.type == "cpu"


_warned: set = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class Call(NamedTuple):
    """What decides which kernel runs a call: each kernel's ``rejects(call)`` reads this."""

    device: torch.device
    dtype: torch.dtype
    D: int
    H: int
    deterministic: bool = True  # backward only
    d_v: int = 0  # value columns (0: D)
    has_len: bool = False  # a per-token topk_length

    @classmethod
    def of(cls, q: torch.Tensor, deterministic: bool = True, d_v: int = 0, has_len: bool = False) -> "Call":
        T, H, D = q.shape
        return cls(q.device, q.dtype, D, H, deterministic, 0 if d_v == D else d_v, has_len)


# Score-only columns after the values that the Triton kernels take (d_v = D - ROPE_D: the
# DeepSeek-V3.2 / GLM-5 layout, 512 + 64).
ROPE_D = 64


@constexpr_function
def scale_words(D: int, rope: bool) -> int:
    """int64 words of a 16-bit partial row's scales (``backward._scaled``): a byte a
    64-column segment, and with ``rope`` (64 score-only columns last) those 64 columns as
    two segments of 32. (Host code and jit functions alike: a compile-time constant in the
    latter.)"""
    return (D // 64 + int(rope) + 7) // 8


def triton_rejects(call: Call) -> str | None:
    """Why the plain Triton kernels (forward and backward) do not take ``call`` (None:
    they do): bf16/fp16 with D in SUPPORTED_D, or d_v in SUPPORTED_D and D = d_v + 64,
    any H, on any CUDA GPU Triton supports."""
    if call.device.type != "cuda":
        return f"{call.device.type} tensors (the kernels run on CUDA)"
    if call.dtype not in KERNEL_DTYPES:
        return f"dtype {call.dtype} (takes bfloat16 and float16)"
    if call.d_v:
        if call.d_v not in SUPPORTED_D or call.D - call.d_v != ROPE_D:
            return (f"D={call.D} with d_v={call.d_v} (takes d_v in {SUPPORTED_D} with D = d_v + {ROPE_D}, "
                    "or d_v = D)")
        return None
    if call.D not in SUPPORTED_D:
        return f"head dim D={call.D} (takes D in {SUPPORTED_D})"
    return None


def last_dim_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels take any strides but the last, which they assume is 1 (vector loads of
    rows; heads of lse/sink addressed as ``base + h``).

    A tensor whose last dim is strided (a slice, or an expanded gradient with stride 0)
    is copied once (documented in the README). None passes through.
    """
    if x is None or x.stride(-1) == 1 or x.numel() == 0:
        return x
    return x.contiguous()


def aligned16(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` where the Gluon kernels can gather its rows with 16-byte copies: the last dim
    contiguous, the base 16-byte aligned and every other stride a multiple of 16 elements
    (what Triton specialises a launch on; without it the cp.async gathers of q, kv and dO do
    not compile, and a failed build would drop the Gluon kernel for the whole process);
    else a contiguous copy, which has all three at D = 512 and 576. Expanded dims (stride 0)
    pass as they are."""
    if x is None or x.numel() == 0:
        return x
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in x.stride()[:-1]):
        return x
    return x.clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def cuda_properties(device: torch.device):
    """The properties of a CUDA device (cached: launchers ask on every call)."""
    return _cuda_properties(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def head_block(H: int) -> int:
    """Heads per program of the Triton kernels: 64 (a full-rate wgmma M) when H > 32;
    below that the kernels are bound by gathered KV bytes and a smaller block (at least
    16, the smallest MMA M) wastes less on padding heads."""
    return 64 if H > 32 else max(16, next_pow2(H))


@triton.jit
def slot_rows(idx_row, offs_k, K, N):
    """Load the ids of slots ``offs_k`` of one token; return (valid, row) as int64.

    Slots past K and ids < 0 or >= N are invalid; an invalid slot's row is 0, so a
    masked id never forms an address (its load is masked off as well).
    """
    ids = tl.load(idx_row + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
    valid = (ids >= 0) & (ids < N)
    return valid, tl.where(valid, ids, 0)


@triton.jit
def slot_end(LEN, pid_t, K, HAS_LEN: tl.constexpr):
    """Slots of token ``pid_t`` to visit: K, or topk_length[t] clamped to [0, K] (the
    slots past it are masked and their blocks skipped)."""
    if HAS_LEN:
        return tl.minimum(tl.maximum(tl.load(LEN + pid_t), 0), K)
    else:
        return K


@triton.jit
def load_tile(ptr, mask, DOT_FP32: tl.constexpr):
    """A masked tile load (0 where masked), as fp32 when DOT_FP32 is set: the
    interpreter mis-computes bf16 dots (docs/design.md#testing-without-a-gpu)."""
    x = tl.load(ptr, mask=mask, other=0.0)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def finish_softmax(m, l_sum, sink2, HAS_SINK: tl.constexpr):
    """(w, lse) of the forward's rows from the running max ``m`` and sum ``l_sum`` of exp2
    (base 2) and the sink ``sink2`` (base 2): out = acc * w, lse in natural log.

    IEEE semantics of lse = log(sum_j exp(s_j) + exp(sink)) (docs/design.md#non-finite-values):
    an empty row gives w = 0 and lse = sink (or -inf); a NaN anywhere in the row (a NaN
    sink, a NaN score) gives w and lse NaN, never "empty"; a +inf sink takes all the weight:
    w = 0, lse = +inf; a -inf sink is no sink. hopper.finish_softmax is the same in Gluon.
    """
    if HAS_SINK:
        m_f = tl.maximum(m, sink2)
        m_s = tl.where(m_f == float("-inf"), 0.0, m_f)
        rescale = tl.exp2(m - m_s)
        l_f = l_sum * rescale + tl.exp2(sink2 - m_s)
    else:
        m_s = m
        rescale = 1.0
        l_f = l_sum
    empty = l_f == 0.0
    l_safe = tl.where(empty, 1.0, l_f)
    w = tl.where(empty, 0.0, rescale / l_safe)
    lse = tl.where(empty, float("-inf"), (m_s + tl.log2(l_safe)) * 0.6931471805599453)
    if HAS_SINK:
        w = tl.where(sink2 == float("inf"), 0.0, w)
        lse = tl.where(sink2 == float("inf"), float("inf"), lse)
    return w, lse


@triton.jit
def _trailing_lengths_kernel(IDX, OUT, T, N, K, stride_it, stride_ik, BLOCK_T: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    last = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(IDX + t[:, None].to(tl.int64) * stride_it + k[None, :].to(tl.int64) * stride_ik,
                      mask=t_ok[:, None] & (k < K)[None, :], other=-1)
        last = tl.maximum(last, tl.where((ids >= 0) & (ids < N), k[None, :] + 1, 0))
    tl.store(OUT + t, tl.max(last, 1), mask=t_ok)


def trailing_lengths(indices: torch.Tensor, N: int) -> torch.Tensor:
    """int32 [T]: 1 + each token's last slot with an id in [0, N) (0 where none is): the
    slots past it are masked, so a kernel that takes it as the token's length skips them
    with the same result (a causal indexer's ids end in -1 until its pool fills). One
    launch; the backward's Delta launch finds the same (``backward._bwd_delta_kernel``)."""
    T, K = indices.shape
    out = torch.empty(T, dtype=torch.int32, device=indices.device)
    if T:
        # (4 tokens x 256 slots a step, 4 KB of int32 ids: a few dependent loads a program,
        # and at T = 4096 eight programs an SM to hide them)
        _trailing_lengths_kernel[(triton.cdiv(T, 4),)](
            indices, out, T, N, K, indices.stride(0), indices.stride(1), BLOCK_T=4, BLOCK_K=256, num_warps=4)
    return out
