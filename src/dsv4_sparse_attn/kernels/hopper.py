"""What the Gluon kernels for Hopper (sm_90) share: Gluon names that moved between Triton
releases, the id loader, the 16-byte dKV reductions, the register split of the
warp-specialised kernels, and the question "can this machine run them at all".

Triton 3.6 to 3.9 are supported (docs/design.md#toolchain-notes): 3.7 renamed
``gl.thread_barrier`` to ``gl.barrier``; 3.8 renamed cp.async's
``async_copy_global_to_shared`` to ``async_load`` (3.9 removed the old name). The aliases
below pick whichever this Triton has, so the kernels are written once.
"""
from __future__ import annotations

import functools

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy as _cp
    _IMPORT_ERROR = None
except ImportError as e:  # a Triton without Gluon's Hopper API
    gluon = gl = _cp = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

from .common import KERNEL_DTYPES, cuda_properties

# Warp specialisation: 3 partitions of one warp group each, under a register limit of
# MAXNREG per thread at launch; setmaxnreg then gives each consumer warp group 232 and
# leaves 40 to the producer (3 x 168 = 40 + 232 + 232; 12 warps x 32 x 168 fit 64K).
NUM_WARPS = 4
MAXNREG = 168
CONSUMER_REGS = 232

if gl is not None:
    # the same two numbers, for use inside the kernels
    PARTITION_WARPS = gl.constexpr(NUM_WARPS)
    PARTITION_REGS = gl.constexpr(CONSUMER_REGS)
    # cp.async gather into shared memory (3.8+: async_load)
    async_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
    # barrier of the threads of a partition (3.7+: gl.barrier)
    thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    @gluon.jit
    def finish_softmax(m, l_sum, sink2, HAS_SINK: gl.constexpr):
        """common.finish_softmax in Gluon: (w, lse) of a row, IEEE semantics for
        non-finite sinks and scores (docs/design.md#non-finite-values)."""
        if HAS_SINK:
            m_f = gl.maximum(m, sink2)
            m_s = gl.where(m_f == float("-inf"), 0.0, m_f)
            rescale = gl.exp2(m - m_s)
            l_f = l_sum * rescale + gl.exp2(sink2 - m_s)
        else:
            m_s = m
            rescale = 1.0
            l_f = l_sum
        empty = l_f == 0.0
        l_safe = gl.where(empty, 1.0, l_f)
        w = gl.where(empty, 0.0, rescale / l_safe)
        lse = gl.where(empty, float("-inf"), (m_s + gl.log2(l_safe)) * 0.6931471805599453)
        if HAS_SINK:
            w = gl.where(sink2 == float("inf"), 0.0, w)
            lse = gl.where(sink2 == float("inf"), float("inf"), lse)
        return w, lse

    @gluon.jit
    def load_ids(idx_row, k0, K, offs):
        """Ids of slots k0 + offs (-1 past K), in the layout of ``offs``."""
        offs_k = k0 + offs
        return gl.load(idx_row + offs_k, mask=offs_k < K, other=-1)

    @gluon.jit
    def fake_group_base(row_ptr, offs_d):
        """[slot, column] -> the int64 address of the column's 16-column group in the slot's
        fp32 row (a thread holds 2 rows x 4 groups of a 64-column piece: 8 distinct values)."""
        return (row_ptr[:, None] + (offs_d[None, :] // 16) * 16).to(gl.int64)

    @gluon.jit
    def red_f32x4_fake(group_base, acc, on):
        """Add a [64, 64] fp32 piece in the wgmma accumulator layout to fp32 rows kept in
        *fake column order*: column 16g + 8h + 2l + b of a row is stored at 16g + 4l + 2h + b
        (``fake_col``), so the four values a thread holds of one row in a 16-column group are
        adjacent and one 16-byte reduction (``red.global.add.v4.f32``, sm_90) adds them: a
        quarter of the reductions of scalar adds, half of Triton's 8-byte ones. The
        conversion to kv's dtype undoes the order.

        ``pack=8`` hands one asm instance a thread's registers i..i+7, which the wgmma layout
        orders (r,c) (r,c+1) (r+8,c) (r+8,c+1) (r,c+8) (r,c+9) (r+8,c+8) (r+8,c+9), with
        c = 16g + 2l, l = lane % 4 (tests/test_sm90_compile.py checks the layout). $0-$7 are
        dummy outputs, $8-$15 the group bases, $16-$23 the values, $24-$31 ``on`` per element:
        a row whose ``on`` is 0 (a masked slot) is not added at all. (The predicate also keeps
        ptxas from serialising the wgmmas, which it did with unpredicated reductions.)
        """
        return gl.inline_asm_elementwise(
            """{
            .reg .pred p, p8;
            .reg .b32 l;
            .reg .b64 o, o8;
            setp.ne.b32 p, $24, 0;
            setp.ne.b32 p8, $26, 0;
            mov.u32 l, %laneid;
            and.b32 l, l, 3;
            mul.wide.u32 o, l, 16;
            add.s64 o8, o, $10;
            add.s64 o, o, $8;
            @p red.relaxed.gpu.global.add.v4.f32 [o], {$16, $17, $20, $21};
            @p8 red.relaxed.gpu.global.add.v4.f32 [o8], {$18, $19, $22, $23};
            mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
            mov.b32 $4, 0; mov.b32 $5, 0; mov.b32 $6, 0; mov.b32 $7, 0;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,l,l,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [group_base, acc, on], dtype=gl.int32, is_pure=False, pack=8)


def fake_col(c: torch.Tensor) -> torch.Tensor:
    """Where column c of a dKV row sits in the fake-ordered fp32 accumulator (see
    ``red_f32x4_fake``): c = 16g + 8h + 2l + b -> 16g + 4l + 2h + b."""
    return (c & ~15) | (((c & 7) >> 1) << 2) | (((c >> 3) & 1) << 1) | (c & 1)


def gluon_unavailable() -> str | None:
    """Why this Triton cannot build the Gluon kernels (None when it can)."""
    return _IMPORT_ERROR


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    p = cuda_properties(torch.device("cuda", index))
    return p.major, p.minor


def hopper_rejects(call) -> str | None:
    """What both Gluon kernels require (None: ``call`` meets it): a Triton with Gluon's
    Hopper API, an sm_90 GPU, bf16/fp16 and D = 512. Each kernel's ``rejects`` adds its own
    head-count rule, if any."""
    if gluon_unavailable():
        return f"no Gluon in this Triton ({gluon_unavailable()})"
    reason = not_sm90(call.device)
    if reason:
        return reason
    if call.dtype not in KERNEL_DTYPES:
        return f"dtype {call.dtype} (takes bfloat16 and float16)"
    if call.D != 512:
        return f"head dim D={call.D} (takes D = 512)"
    if call.d_v:
        return f"d_v={call.d_v} < D={call.D} (values narrower than keys)"
    return None


def not_sm90(device: torch.device) -> str | None:
    """None on an sm_90 GPU (H100/H200), else why not. The Gluon kernels use wgmma,
    setmaxnreg and 16-byte vector reductions: Hopper only."""
    if device.type != "cuda":
        return f"{device.type} tensors (the Gluon kernels run on CUDA)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _capability(index)
    if cc != (9, 0):
        return f"compute capability {cc[0]}.{cc[1]} (the Gluon kernels need sm_90, H100/H200)"
    return None
