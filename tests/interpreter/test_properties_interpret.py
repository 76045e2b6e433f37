"""The Triton kernels (forward, backward in both modes) under the Triton interpreter
against tests/properties.py's float64 oracle: random shapes that cross the head and slot
blocks, every id pattern, non-finite sinks and inputs. Outputs are poisoned (NaN) before
the launch. Degenerate calls (T, H, K or N = 0) never reach the kernels (dispatch runs
the reference); T = 0 is still drawn, the launchers return before launching."""
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_triton, forward_triton
from properties import assert_matches, problems, property_settings

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 set before triton is imported "
           "(tests/interpreter/conftest.py reruns these tests in a child process with it)")

# D = 128 and 192 with d_v = D - 64: the V3.2 layout's 64 score-only columns, at small widths
KERNEL_PROBLEMS = problems(D=(64, 128, 192), H=(1, 70), T=(0, 3), K=(1, 70), N=(1, 80),
                           dtypes=(torch.bfloat16, torch.float16),
                           narrow_values={64: [None], 128: [None, 64], 192: [128]})


@given(KERNEL_PROBLEMS, st.booleans())
@property_settings(150)
def test_triton_kernels_match_the_oracle(p, deterministic):
    T, H, D = p.q.shape
    scale = D ** -0.5 if p.scale is None else p.scale
    out = torch.full_like(p.grad_out, float("nan"))
    lse = torch.full((T, H), float("nan"))
    forward_triton.sparse_mla_fwd(p.q, p.kv, p.idx, p.sink, scale, out=out, lse=lse,
                                  topk_length=p.topk_length, d_v=p.d_v)
    dq = torch.full_like(p.q, float("nan"))
    grads = kbwd.sparse_mla_bwd(p.grad_out, p.grad_lse, p.q, p.kv, out, lse, p.idx, p.sink, scale,
                                main=backward_triton, deterministic=deterministic, grad_q=dq,
                                topk_length=p.topk_length)
    assert_matches(p, (out, lse) + tuple(grads))
