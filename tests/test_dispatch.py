"""The dispatcher's kernel choice and fallback policy (CPU: the kernels are replaced by stubs).

A Gluon kernel that cannot be built hands its shapes to the Triton kernel for the rest
of the process; any other failure of a Gluon launch (out of memory, a CUDA error) must
reach the caller and leave the Gluon kernel in use.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import backward_gluon, common, dispatch, forward_gluon
from dsv4_sparse_attn.kernels import forward as kfwd

P = SimpleNamespace(D=512, H=64, scale=512 ** -0.5)


def _args():
    q = torch.zeros(2, P.H, P.D, dtype=torch.bfloat16)
    return q, torch.zeros(3, P.D, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.int32)


@pytest.fixture
def gluon_eligible(monkeypatch):
    """Every call is Gluon-eligible; no Gluon kernel has failed; warnings are fresh."""
    monkeypatch.setattr(dispatch, "_gluon_broken", {"fwd": False, "bwd": False})
    monkeypatch.setattr(common, "_warned", set())
    monkeypatch.setattr(backward_gluon, "supported", lambda q, D, H, deterministic=True: True)
    monkeypatch.setattr(forward_gluon, "supported", lambda q, D, H: True)


def _stub_backward(monkeypatch, gluon_error):
    calls = []

    def fake(*args, gluon=False, **kw):
        calls.append(gluon)
        if gluon:
            raise gluon_error
        return "triton"

    monkeypatch.setattr(kbwd, "sparse_mla_bwd", fake)
    return calls


def _backward():
    q, kv, idx = _args()
    return dispatch.backward(q, None, q, kv, q, None, idx, None, P)


@pytest.mark.parametrize("error", [CompilationError("def k(): pass", None, "bad Gluon API"),
                                   OutOfResources(300000, 232448, "shared memory"),
                                   RuntimeError("PassManager::run failed")],
                         ids=["compile", "out-of-resources", "mlir"])
def test_backward_build_failure_falls_back_to_triton_once(gluon_eligible, monkeypatch, error):
    calls = _stub_backward(monkeypatch, error)
    with pytest.warns(RuntimeWarning, match="failed to build"):
        assert _backward() == "triton"
    assert calls == [True, False] and dispatch._gluon_broken["bwd"]
    assert _backward() == "triton" and calls == [True, False, False]  # Gluon not tried again


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   ValueError("bad input")],
                         ids=["oom", "cuda-error", "value-error"])
def test_backward_runtime_failure_reaches_the_caller(gluon_eligible, monkeypatch, error):
    calls = _stub_backward(monkeypatch, error)
    with pytest.raises(type(error), match=str(error)[:20]):
        _backward()
    assert calls == [True] and not dispatch._gluon_broken["bwd"]


def test_forward_follows_the_same_policy(gluon_eligible, monkeypatch):
    monkeypatch.setattr(kfwd, "sparse_mla_fwd", lambda *a, **k: "triton")
    q, kv, idx = _args()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(forward_gluon, "sparse_mla_fwd", oom)
    with pytest.raises(torch.OutOfMemoryError):
        dispatch.forward(q, kv, idx, None, P)
    assert not dispatch._gluon_broken["fwd"]

    def broken(*a, **k):
        raise CompilationError("def k(): pass", None, "bad Gluon API")

    monkeypatch.setattr(forward_gluon, "sparse_mla_fwd", broken)
    with pytest.warns(RuntimeWarning, match="failed to build"):
        assert dispatch.forward(q, kv, idx, None, P) == "triton"
    assert dispatch._gluon_broken["fwd"]


@pytest.mark.parametrize("H,fwd,bwd_det,bwd_atomic", [(1, False, True, False), (16, False, True, False),
                                                       (17, True, True, True), (128, True, True, True)])
def test_gluon_kernels_take_the_measured_head_counts(monkeypatch, H, fwd, bwd_det, bwd_atomic):
    """On an sm_90 GPU (stubbed here): the Gluon forward from H = 17; the Gluon backward
    main kernel at any H when deterministic, from H = 17 on the atomic path (NOTES.md)."""
    monkeypatch.setattr(forward_gluon, "sm90_takes", lambda q, D: True)
    monkeypatch.setattr(backward_gluon, "sm90_takes", lambda q, D: True)
    q = torch.zeros(1, H, 512, dtype=torch.bfloat16)
    assert forward_gluon.supported(q, 512, H) == fwd
    assert backward_gluon.supported(q, 512, H) == bwd_det
    assert backward_gluon.supported(q, 512, H, deterministic=False) == bwd_atomic


def test_cpu_tensors_never_take_a_gluon_kernel():
    q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    assert not forward_gluon.supported(q, 512, 64) and not backward_gluon.supported(q, 512, 64)


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_asks_the_gluon_rule_for_its_mode(gluon_eligible, monkeypatch, deterministic):
    asked = []
    monkeypatch.setattr(backward_gluon, "supported", lambda q, D, H, **rule: asked.append(rule) or False)
    monkeypatch.setattr(kbwd, "sparse_mla_bwd", lambda *a, gluon=False, **k: "gluon" if gluon else "triton")
    monkeypatch.setattr(dispatch, "_deterministic", deterministic)
    assert _backward() == "triton"
    assert asked == [{"deterministic": deterministic}]
