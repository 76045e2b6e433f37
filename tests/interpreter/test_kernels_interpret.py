"""The Triton kernels under the Triton interpreter on CPU tensors, vs the float64 reference.

They need TRITON_INTERPRET=1 from the start of the process; without it conftest.py in
this directory reruns them in a child process that has it (CI has no GPU).
The interpreter mis-computes bf16 dots, so the kernels cast dot operands to fp32 when
they run on the CPU (DOT_FP32); bf16 cases still exercise bf16 loads and stores.
"""
import os

import pytest
import torch

from kernel_checks import Case, check_backward, check_forward

# A guard: without the variable, conftest.py hands these tests to a child process before
# they run, so this skip is only reached if that hand-over was bypassed.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs TRITON_INTERPRET=1 set before triton is imported "
           "(tests/interpreter/conftest.py reruns these tests in a child process with it)")

BF, FP = torch.bfloat16, torch.float16
CASES = [
    Case(1, 1, 64, 5, 1, dtype=FP),
    Case(3, 3, 64, 20, 37, dtype=FP),
    Case(2, 70, 64, 30, 70, dtype=FP),  # two head blocks, tail head block
    Case(4, 5, 128, 50, 70, dtype=BF, ids="deepseek"),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="empty_rows"),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="empty_rows", sink=False),
    Case(4, 4, 64, 30, 40, dtype=FP, ids="dup"),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="extreme", idx_dtype=torch.int32),
    Case(4, 4, 64, 30, 20, dtype=FP, ids="extreme", idx_dtype=torch.int64),
    Case(8, 4, 64, 30, 20, dtype=FP, ids="shared"),
    Case(4, 4, 64, 30, 20, dtype=FP, sink_scale=30.0),
    Case(4, 4, 64, 30, 20, dtype=FP, sink_scale=-30.0),
    Case(4, 4, 64, 30, 20, dtype=FP, noncontig=True, sink=False),
    Case(2, 2, 256, 30, 9, dtype=FP),
    Case(6, 4, 64, 30, 70, dtype=FP, lengths=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_interpreted(case):
    check_forward(case, "cpu")


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_backward_interpreted(case, deterministic):
    check_backward(case, "cpu", deterministic=deterministic)


def test_backward_without_grad_lse_interpreted():
    check_backward(Case(3, 4, 64, 30, 20, dtype=FP), "cpu", with_dlse=False)
