"""Op schemas and argument errors, pinned inline with expecttest.

Regenerate the pinned strings after an intended change with
``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_validation.py`` and review the diff.
"""
from __future__ import annotations

import math

import pytest
import torch
from expecttest import assert_expected_inline

import dsv4_sparse_attn  # noqa: F401  (registers torch.ops.dsv4.*)

FWD = torch.ops.dsv4.sparse_mla_fwd
BWD = torch.ops.dsv4.sparse_mla_bwd
MLA = torch.ops.dsv4.sparse_mla

T, H, D, N, K = 3, 2, 8, 5, 4


def error_of(fn) -> str:
    """'ExceptionType: message' of what fn raises (fails the test if it raises nothing)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    raise AssertionError("expected an exception, none was raised")


def render(msgs) -> str:
    """{name: 'Type: message'} as 'name: Type' then the indented message (short lines)."""
    lines = []
    for name, m in msgs.items():
        typ, msg = m.split(": ", 1)
        lines += [f"{name}: {typ}", f"    {msg}"]
    return "\n".join(lines)


def schema_text(op) -> str:
    """The schema with one argument a line."""
    head, ret = str(op.default._schema).rsplit(" -> ", 1)
    name, args = head.split("(", 1)
    return name + "(\n    " + ",\n    ".join(args[:-1].split(", ")) + "\n) -> " + ret


def base(dtype=torch.float32, device="cpu"):
    q = torch.randn(T, H, D, dtype=dtype, device=device)
    kv = torch.randn(N, D, dtype=dtype, device=device)
    idx = torch.randint(-1, N, (T, K), dtype=torch.int32, device=device)
    s = torch.randn(H, device=device)
    return q, kv, idx, s


# --------------------------------------------------------------------------- schemas
def test_schemas():
    assert_expected_inline(
        schema_text(MLA),
        """\
dsv4::sparse_mla(
    Tensor q,
    Tensor kv,
    Tensor indices,
    Tensor? attn_sink=None,
    float? scale=None,
    Tensor? topk_length=None,
    SymInt? d_v=None
) -> (Tensor, Tensor)""",
    )
    assert_expected_inline(
        schema_text(FWD),
        """\
dsv4::sparse_mla_fwd(
    Tensor q,
    Tensor kv,
    Tensor indices,
    Tensor? attn_sink=None,
    float? scale=None,
    Tensor? topk_length=None,
    SymInt? d_v=None
) -> (Tensor, Tensor)""",
    )
    assert_expected_inline(
        schema_text(BWD),
        """\
dsv4::sparse_mla_bwd(
    Tensor grad_out,
    Tensor? grad_lse,
    Tensor q,
    Tensor kv,
    Tensor out,
    Tensor lse,
    Tensor indices,
    Tensor? attn_sink=None,
    float? scale=None,
    Tensor? topk_length=None,
    SymInt? d_v=None
) -> (Tensor, Tensor, Tensor)""",
    )


# --------------------------------------------------------------------------- forward errors
def _fwd(q, kv, idx, s, scale=None, op=FWD, topk_length=None, d_v=None):
    return lambda: op(q, kv, idx, s, scale, topk_length, d_v)


def fwd_cases(dev="cpu"):
    """name -> zero-argument callable that must raise, built on device ``dev``."""
    q, kv, idx, s = base(device=dev)
    return {
        "q_rank": _fwd(q[0], kv, idx, s),
        "q_rank_4d": _fwd(q[None], kv, idx, s),
        "kv_rank_1d": _fwd(q, kv[0], idx, s),
        "kv_rank_4d": _fwd(q, kv[:, None, None], idx, s),
        "kv_middle_dim": _fwd(q, kv[:, None].expand(N, 2, D), idx, s),
        "indices_rank": _fwd(q, kv, idx[0], s),
        "indices_rank_3d": _fwd(q, kv, idx[None], s),
        "T_mismatch": _fwd(q, kv, idx[:2], s),
        "D_mismatch": _fwd(q, kv[:, :6], idx, s),
        "float_indices": _fwd(q, kv, idx.float(), s),
        "int16_indices": _fwd(q, kv, idx.to(torch.int16), s),
        "int_q": _fwd(q.to(torch.int32), kv.to(torch.int32), idx, s),
        "kv_dtype": _fwd(q, kv.bfloat16(), idx, s),
        "sink_shape": _fwd(q, kv, idx, s[:1]),
        "sink_rank": _fwd(q, kv, idx, s[None]),
        "sink_dtype_bf16": _fwd(q, kv, idx, s.bfloat16()),
        "sink_dtype_f64": _fwd(q, kv, idx, s.double()),
        "scale_zero": _fwd(q, kv, idx, s, 0.0),
        "scale_negative": _fwd(q, kv, idx, s, -1.0),
        "scale_inf": _fwd(q, kv, idx, s, math.inf),
        "scale_nan": _fwd(q, kv, idx, s, math.nan),
        "topk_length_dtype": _fwd(q, kv, idx, s, topk_length=torch.ones(q.shape[0], dtype=torch.int64,
                                                                        device=dev)),
        "topk_length_shape": _fwd(q, kv, idx, s, topk_length=torch.ones(q.shape[0] + 1, dtype=torch.int32,
                                                                        device=dev)),
        "topk_length_rank": _fwd(q, kv, idx, s, topk_length=torch.ones(q.shape[0], 1, dtype=torch.int32,
                                                                       device=dev)),
        "d_v_zero": _fwd(q, kv, idx, s, d_v=0),
        "d_v_above_D": _fwd(q, kv, idx, s, d_v=q.shape[-1] + 1),
    }


def test_forward_errors():
    cases = fwd_cases()
    msgs = {name: error_of(fn) for name, fn in cases.items()}
    assert_expected_inline(
        render(msgs),
        """\
q_rank: ValueError
    sparse_mla: q must be a 3-D tensor [T, H, D], got shape [2, 8]
q_rank_4d: ValueError
    sparse_mla: q must be a 3-D tensor [T, H, D], got shape [1, 3, 2, 8]
kv_rank_1d: ValueError
    sparse_mla: kv must have shape [N, D] or [N, 1, D], got shape [8]
kv_rank_4d: ValueError
    sparse_mla: kv must have shape [N, D] or [N, 1, D], got shape [5, 1, 1, 8]
kv_middle_dim: ValueError
    sparse_mla: kv must have shape [N, D] or [N, 1, D], got shape [5, 2, 8]
indices_rank: ValueError
    sparse_mla: indices must have shape [T, K] with T=3 (q's first dim), got shape [4]
indices_rank_3d: ValueError
    sparse_mla: indices must have shape [T, K] with T=3 (q's first dim), got shape [1, 3, 4]
T_mismatch: ValueError
    sparse_mla: indices must have shape [T, K] with T=3 (q's first dim), got shape [2, 4]
D_mismatch: ValueError
    sparse_mla: kv's last dim must equal q's head dim D=8, got kv shape [5, 6]
float_indices: TypeError
    sparse_mla: indices must have dtype int32 or int64, got torch.float32
int16_indices: TypeError
    sparse_mla: indices must have dtype int32 or int64, got torch.int16
int_q: TypeError
    sparse_mla: q must have dtype bfloat16, float16 or float32 (float64 for checking), got torch.int32
kv_dtype: TypeError
    sparse_mla: kv must have the same dtype as q (torch.float32), got torch.bfloat16
sink_shape: ValueError
    sparse_mla: attn_sink must have shape [H] with H=2, got shape [1]
sink_rank: ValueError
    sparse_mla: attn_sink must have shape [H] with H=2, got shape [1, 2]
sink_dtype_bf16: TypeError
    sparse_mla: attn_sink must have dtype float32, got torch.bfloat16
sink_dtype_f64: TypeError
    sparse_mla: attn_sink must have dtype float32, got torch.float64
scale_zero: ValueError
    sparse_mla: scale must be a finite positive number, got 0.0
scale_negative: ValueError
    sparse_mla: scale must be a finite positive number, got -1.0
scale_inf: ValueError
    sparse_mla: scale must be a finite positive number, got inf
scale_nan: ValueError
    sparse_mla: scale must be a finite positive number, got nan
topk_length_dtype: TypeError
    sparse_mla: topk_length must have dtype int32, got torch.int64
topk_length_shape: ValueError
    sparse_mla: topk_length must have shape [T] with T=3 (q's first dim), got shape [4]
topk_length_rank: ValueError
    sparse_mla: topk_length must have shape [T] with T=3 (q's first dim), got shape [3, 1]
d_v_zero: ValueError
    sparse_mla: d_v must be in [1, D] = [1, 8] (values are kv[:, :d_v]), got 0
d_v_above_D: ValueError
    sparse_mla: d_v must be in [1, D] = [1, 8] (values are kv[:, :d_v]), got 9""",
    )
    # the differentiable op validates identically
    q, kv, idx, s = base()
    assert error_of(_fwd(q[0], kv, idx, s, op=MLA)) == msgs["q_rank"]
    assert error_of(_fwd(q, kv, idx, s, -1.0, op=MLA)) == msgs["scale_negative"]


def test_error_types():
    cases = fwd_cases()
    types = {
        "float_indices": TypeError, "int16_indices": TypeError, "int_q": TypeError,
        "kv_dtype": TypeError, "sink_dtype_bf16": TypeError, "sink_dtype_f64": TypeError,
        "topk_length_dtype": TypeError,
    }
    for name, fn in cases.items():
        with pytest.raises(types.get(name, ValueError)):
            fn()


def test_device_mismatch():
    q, kv, idx, s = base()
    meta = lambda x: x.to("meta")  # noqa: E731  (a second device on a CPU-only machine)
    msgs = [
        error_of(_fwd(q, meta(kv), idx, s)),
        error_of(_fwd(q, kv, meta(idx), s)),
        error_of(_fwd(q, kv, idx, meta(s))),
        error_of(_fwd(meta(q), kv, idx, s)),
    ]
    assert_expected_inline(
        render(dict(enumerate(msgs))),
        """\
0: ValueError
    sparse_mla: kv must be on the same device as q (cpu), got meta
1: ValueError
    sparse_mla: indices must be on the same device as q (cpu), got meta
2: ValueError
    sparse_mla: attn_sink must be on the same device as q (cpu), got meta
3: ValueError
    sparse_mla: kv must be on the same device as q (meta), got cpu""",
    )
    with pytest.raises(ValueError):
        _fwd(q, meta(kv), idx, s)()


# --------------------------------------------------------------------------- backward errors
def bwd_cases(dev="cpu"):
    q, kv, idx, s = base(device=dev)
    out = torch.randn(T, H, D, device=dev)
    lse = torch.randn(T, H, device=dev)
    do, dlse = torch.randn_like(out), torch.randn_like(lse)

    def b(do=do, dlse=dlse, q=q, kv=kv, out=out, lse=lse, idx=idx, s=s, scale=None):
        return lambda: BWD(do, dlse, q, kv, out, lse, idx, s, scale)

    return {
        "grad_out_shape": b(do=do[:, :1]),
        "grad_out_dtype": b(do=do.bfloat16()),
        "out_shape": b(out=out[:2]),
        "out_dtype": b(out=out.double()),
        "lse_shape": b(lse=lse[:, :1]),
        "lse_dtype": b(lse=lse.bfloat16()),
        "grad_lse_shape": b(dlse=dlse[None]),
        "grad_lse_dtype": b(dlse=dlse.double()),
        "q_rank": b(q=q[0]),
        "sink_dtype": b(s=s.half()),
        "scale_zero": b(scale=0.0),
    }


def test_backward_errors():
    msgs = {name: error_of(fn) for name, fn in bwd_cases().items()}
    assert_expected_inline(
        render(msgs),
        """\
grad_out_shape: ValueError
    sparse_mla: grad_out must have shape [T, H, d_v] = [3, 2, 8], got shape [3, 1, 8]
grad_out_dtype: TypeError
    sparse_mla: grad_out must have q's dtype (torch.float32), got torch.bfloat16
out_shape: ValueError
    sparse_mla: out must have shape [T, H, d_v] = [3, 2, 8], got shape [2, 2, 8]
out_dtype: TypeError
    sparse_mla: out must have q's dtype (torch.float32), got torch.float64
lse_shape: ValueError
    sparse_mla: lse must have shape [T, H] = [3, 2], got shape [3, 1]
lse_dtype: TypeError
    sparse_mla: lse must have dtype torch.float32, got torch.bfloat16
grad_lse_shape: ValueError
    sparse_mla: grad_lse must have shape [T, H] = [3, 2], got shape [1, 3, 2]
grad_lse_dtype: TypeError
    sparse_mla: grad_lse must have dtype torch.float32, got torch.float64
q_rank: ValueError
    sparse_mla: q must be a 3-D tensor [T, H, D], got shape [2, 8]
sink_dtype: TypeError
    sparse_mla: attn_sink must have dtype float32, got torch.float16
scale_zero: ValueError
    sparse_mla: scale must be a finite positive number, got 0.0""",
    )
    assert msgs["grad_out_shape"].startswith("ValueError")
    assert msgs["grad_out_dtype"].startswith("TypeError")


# --------------------------------------------------------------------------- fake / meta
def test_meta_tensors_raise_the_same_errors():
    cpu_f, meta_f = fwd_cases("cpu"), fwd_cases("meta")
    for name in cpu_f:
        assert error_of(meta_f[name]) == error_of(cpu_f[name]), name
    cpu_b, meta_b = bwd_cases("cpu"), bwd_cases("meta")
    for name in cpu_b:
        assert error_of(meta_b[name]) == error_of(cpu_b[name]), name


def test_fake_tensor_mode_raises_the_same_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu_msgs = {name: error_of(fn) for name, fn in fwd_cases("cpu").items()}
    with FakeTensorMode():
        fake_msgs = {name: error_of(fn) for name, fn in fwd_cases("cpu").items()}
    assert fake_msgs == cpu_msgs


def _meta(x):
    return None if x is None else x.to("meta")


def _same_layout(real, fake, what):
    assert fake.device.type == "meta", what
    assert fake.shape == real.shape, (what, fake.shape, real.shape)
    assert fake.dtype == real.dtype, (what, fake.dtype, real.dtype)
    assert fake.stride() == real.stride(), (what, fake.stride(), real.stride())


LAYOUT_CASES = [
    pytest.param(
        dt, sink, kv3, dlse, id=f"{str(dt)[6:]}-sink{int(sink)}-kv{3 if kv3 else 2}d-dlse{int(dlse)}"
    )
    for dt in (torch.float32, torch.bfloat16, torch.float16)
    for sink in (True, False)
    for kv3 in (False, True)
    for dlse in (True, False)
] + [
    pytest.param(torch.float64, True, False, True, id="float64-sink1-kv2d-dlse1"),
    pytest.param(torch.float64, False, False, True, id="float64-sink0-kv2d-dlse1"),
]


@pytest.mark.parametrize("dtype,sink,kv3,with_dlse", LAYOUT_CASES)
def test_fake_outputs_match_real(dtype, sink, kv3, with_dlse):
    torch.manual_seed(hash((str(dtype), sink, kv3, with_dlse)) % 2**31)
    q, kv, idx, s = base(dtype)
    if dtype == torch.float64 and sink:
        s = s.double()
    if not sink:
        s = None
    if kv3:
        kv = kv[:, None]
    q_nc = torch.randn(H, T, D, dtype=dtype).transpose(0, 1)  # a non-contiguous q too
    for qq in (q, q_nc):
        out, lse = FWD(qq, kv, idx, s, 0.3)
        fo, fl = FWD(_meta(qq), _meta(kv), _meta(idx), _meta(s), 0.3)
        _same_layout(out, fo, "out")
        _same_layout(lse, fl, "lse")
        mo, ml = MLA(_meta(qq), _meta(kv), _meta(idx), _meta(s), 0.3)
        _same_layout(out, mo, "out (sparse_mla)")
        _same_layout(lse, ml, "lse (sparse_mla)")
        do = torch.randn_like(out)
        dlse = torch.randn_like(lse) if with_dlse else None
        real = BWD(do, dlse, qq, kv, out, lse, idx, s, 0.3)
        fake = BWD(*(_meta(x) for x in (do, dlse, qq, kv, out, lse, idx, s)), 0.3)
        for r, f, what in zip(real, fake, ("grad_q", "grad_kv", "grad_sink")):
            _same_layout(r, f, what)


def test_fake_kernels_accept_defaults():
    """Calls that leave attn_sink / scale at their defaults must work on meta tensors.

    The dispatcher drops trailing arguments equal to their schema defaults before it calls
    a Python kernel, so the fake kernels must carry the defaults too.
    """
    q, kv, idx, s = (_meta(x) for x in base())
    out, lse = FWD(q, kv, idx)
    assert out.shape == (T, H, D) and lse.shape == (T, H)
    out, lse = MLA(q, kv, idx, s)
    out, lse = FWD(q, kv, idx, None, None)
    dq, dkv, ds = BWD(out, None, q, kv, out, lse, idx)
    assert dq.shape == q.shape and dkv.shape == kv.shape and ds.shape == (0,)
    dq, dkv, ds = BWD(out, lse, q, kv, out, lse, idx, s)
    assert ds.shape == (H,)
