"""The dispatcher: its ordered candidates, each kernel's rule, the fallback policy and the
backward's mode (CPU: the kernels' rules and launchers are replaced by stubs).

A Gluon kernel that cannot be built hands its calls to the next candidate for the rest of
the process; any other failure of a Gluon launch (out of memory, a CUDA error) must reach
the caller and leave the Gluon kernel in use.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

import dsv4_sparse_attn
from dsv4_sparse_attn.kernels import backward as kbwd
from dsv4_sparse_attn.kernels import (backward_gluon, backward_triton, common, dispatch, forward_gluon,
                                      forward_triton)
from dsv4_sparse_attn.kernels.common import Call

P = SimpleNamespace(T=2, H=64, D=512, N=3, K=4, d_v=512, has_len=False, scale=512 ** -0.5)  # _args()


def _args():
    q = torch.zeros(2, P.H, P.D, dtype=torch.bfloat16)
    return q, torch.zeros(3, P.D, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.int32)


@pytest.fixture
def fresh(monkeypatch):
    """No kernel has failed, nothing is forced or remembered, warnings are fresh."""
    monkeypatch.setattr(dispatch, "_broken", {})
    monkeypatch.setattr(dispatch, "_forced", {})
    monkeypatch.setattr(dispatch, "_choices", {})
    monkeypatch.setattr(common, "_warned", set())


@pytest.fixture
def every_kernel_takes(fresh, monkeypatch):
    for mod in (forward_gluon, forward_triton, backward_gluon, backward_triton):
        monkeypatch.setattr(mod, "rejects", lambda call: None)


def _stub_backward(monkeypatch, gluon_error):
    calls = []

    def fake(*args, main=None, **kw):
        calls.append(main.NAME)
        if main is backward_gluon:
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
def test_backward_build_failure_falls_back_to_triton_once(every_kernel_takes, monkeypatch, error):
    calls = _stub_backward(monkeypatch, error)
    with pytest.warns(RuntimeWarning) as w:
        assert _backward() == "triton"
    msg = str(w[0].message)
    # the warning names the kernel, the Triton version and the reason
    assert "backward_gluon" in msg and triton.__version__ in msg and type(error).__name__ in msg, msg
    assert calls == ["gluon_sm90", "triton"] and "backward_gluon" in dispatch._broken
    assert _backward() == "triton" and calls == ["gluon_sm90", "triton", "triton"]  # Gluon not tried again
    q = _args()[0]
    reasons = {n: r for n, m, r in dispatch.candidates("backward", Call.of(q))}
    assert "failed to build" in reasons["gluon_sm90"]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   ValueError("bad input")],
                         ids=["oom", "cuda-error", "value-error"])
def test_backward_runtime_failure_reaches_the_caller(every_kernel_takes, monkeypatch, error):
    calls = _stub_backward(monkeypatch, error)
    with pytest.raises(type(error), match=str(error)[:20]):
        _backward()
    assert calls == ["gluon_sm90"] and not dispatch._broken


def test_forward_follows_the_same_policy(every_kernel_takes, monkeypatch):
    monkeypatch.setattr(forward_triton, "sparse_mla_fwd", lambda *a, **k: "triton")
    q, kv, idx = _args()

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(forward_gluon, "sparse_mla_fwd", oom)
    with pytest.raises(torch.OutOfMemoryError):
        dispatch.forward(q, kv, idx, None, P)
    assert not dispatch._broken

    def broken(*a, **k):
        raise CompilationError("def k(): pass", None, "bad Gluon API")

    monkeypatch.setattr(forward_gluon, "sparse_mla_fwd", broken)
    with pytest.warns(RuntimeWarning, match="forward_gluon failed to build"):
        assert dispatch.forward(q, kv, idx, None, P) == "triton"
    assert "forward_gluon" in dispatch._broken


@pytest.mark.parametrize("H,fwd", [(1, False), (16, False), (17, True), (128, True)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_gluon_kernels_take_the_measured_head_counts(monkeypatch, H, fwd, deterministic):
    """On an sm_90 GPU (stubbed here): the Gluon forward from H = 17
    (docs/performance/forward.md#which-forward-below-64-heads), the Gluon backward main
    kernel at any H in both modes (docs/performance/backward.md#small-head-counts)."""
    from dsv4_sparse_attn.kernels import hopper

    monkeypatch.setattr(hopper, "not_sm90", lambda device: None)
    call = Call(torch.device("cuda", 0), torch.bfloat16, 512, H, deterministic)
    assert (forward_gluon.rejects(call) is None) == fwd
    assert backward_gluon.rejects(call) is None
    for bad in (call._replace(D=256), call._replace(dtype=torch.float32)):
        assert forward_gluon.rejects(bad) and backward_gluon.rejects(bad)


@pytest.mark.parametrize("deterministic,n_hb,K,want", [
    (False, 1, 640, "SPLIT_ROLES"), (False, 2, 1152, "SPLIT_ROLES"),
    (True, 1, 640, "SPLIT_ROLES_DET_ONE_HB"), (True, 1, 512, "SPLIT_ROLES_DET_ONE_HB"),
    (True, 1, 160, "SPLIT_ROLES_DET"), (True, 2, 1152, "SPLIT_ROLES_DET")])
def test_gluon_backward_schedule_follows_the_measurements(monkeypatch, deterministic, n_hb, K, want):
    """The Gluon backward's schedule (``_split``): the fast mode's default at every H; the
    deterministic one split 1 at one head block from SPLIT_DET_MIN_K slots (measured 1.4-3.2%
    less time, bitwise equal), unsplit at two or more head blocks and at short K
    (docs/performance/backward.md#split-roles); ``launch(split=...)`` wins."""
    for i, name in enumerate(("SPLIT_ROLES", "SPLIT_ROLES_DET", "SPLIT_ROLES_DET_ONE_HB")):
        monkeypatch.setattr(backward_gluon, name, 10 + i)  # (distinct stand-ins)
    got = backward_gluon._split(deterministic, None, n_hb, K)
    assert got == getattr(backward_gluon, want)
    assert backward_gluon._split(deterministic, 0, n_hb, K) == 0
    assert backward_gluon.SPLIT_DET_MIN_K == 512


def test_gluon_backward_evict_last_where_the_accumulator_outgrows_the_l2(monkeypatch):
    """The fast mode's reductions carry the L2 evict-last policy where the fp32 [N, D]
    accumulator is at least EVICT_LAST_MIN_L2 times the L2 (an H200's 60 MB here), unless
    ``launch(evict_last=...)`` says otherwise; none off the GPU."""
    props = SimpleNamespace(L2_cache_size=60 * 2**20)
    monkeypatch.setattr(backward_gluon, "cuda_properties", lambda device: props)
    gpu = torch.device("cuda", 0)
    rows = backward_gluon.EVICT_LAST_MIN_L2 * props.L2_cache_size // (512 * 4)
    assert not backward_gluon._evict_last(rows - 1, 512, gpu, None)
    assert backward_gluon._evict_last(rows, 512, gpu, None)
    assert backward_gluon._evict_last(163840, 512, gpu, None)  # T = 131072
    assert not backward_gluon._evict_last(40960, 512, gpu, None)  # T = 32768
    assert not backward_gluon._evict_last(163840, 512, gpu, False)
    assert backward_gluon._evict_last(10, 512, gpu, True)
    assert not backward_gluon._evict_last(163840, 512, torch.device("cpu"), None)


@pytest.mark.parametrize("H,want", [(1, 16), (16, 16), (17, 32), (32, 32), (33, 64), (64, 64), (128, 64)])
def test_gluon_backward_dkv_products_contract_over_the_heads_a_tile_holds(monkeypatch, H, want):
    """``_head_pad``: the dKV products of a tile of H <= 16 or 32 heads contract over 16 or 32
    heads, not 64 (P's and dS's rows past H are zeros); off (``HEAD_PAD``) or overridden
    by ``launch(head_pad=...)``, never below the heads a tile holds."""
    assert backward_gluon.HEAD_PAD is True
    assert backward_gluon._head_pad(H) == want
    assert backward_gluon._head_pad(H, 64) == 64
    monkeypatch.setattr(backward_gluon, "HEAD_PAD", False)
    assert backward_gluon._head_pad(H) == 64
    for bad in (8, 48, 128) + ((16,) if want > 16 else ()):
        with pytest.raises(ValueError, match="head_pad"):
            backward_gluon._head_pad(H, bad)


@pytest.mark.parametrize("W, D, want", [(512, 512, True), (576, 512, True), (320, 256, False),
                                        (576, 576, False)])
def test_gluon_backward_16_bit_rows_by_default_where_measured(monkeypatch, W, D, want):
    """``partial16_default``: 16-bit partial rows at D = 512 and at the 576/512 layout (at
    any head count: the 16-, 32- and 64-head tiles were timed) under Triton 3.6, at D = 512
    alone under 3.9 (where they were timed); fp32 rows elsewhere and under the Tritons not
    timed (3.7, 3.8)."""
    monkeypatch.setattr(backward_gluon, "TRITON_VERSION", (3, 6))
    assert backward_gluon.partial16_default(W, D) is want
    monkeypatch.setattr(backward_gluon, "TRITON_VERSION", (3, 9))
    assert backward_gluon.partial16_default(W, D) is (want and (W, D) == (512, 512))
    for untimed in ((3, 7), (3, 8)):
        monkeypatch.setattr(backward_gluon, "TRITON_VERSION", untimed)
        assert backward_gluon.partial16_default(W, D) is False


def test_gluon_backward_transposes_small_head_tiles_in_the_fast_split_schedules(monkeypatch):
    """``_transposed``: the fast mode's split schedules at D = 512 transpose a tile of 16 or 32
    heads (measured under Triton 3.6: 3.1-6.0% less time than ``HEAD_PAD`` alone, so on there);
    not at 64 heads, not unsplit, not the 576/512 layout, not the deterministic mode;
    ``launch(transposed=...)`` overrides."""
    from dsv4_sparse_attn.kernels.hopper import TRITON_VERSION

    t = backward_gluon._transposed
    assert backward_gluon.SMALL_H_TRANSPOSED == (TRITON_VERSION in ((3, 6), (3, 8), (3, 9)))  # (where timed)
    monkeypatch.setattr(backward_gluon, "SMALL_H_TRANSPOSED", True)
    assert t(16, 2, 0, False) and t(32, 1, 0, False)
    assert not t(64, 2, 0, False) and not t(16, 0, 0, False)
    assert not t(16, 2, 64, False) and not t(16, 2, 0, True)
    assert not t(16, 2, 0, False, False)
    monkeypatch.setattr(backward_gluon, "SMALL_H_TRANSPOSED", False)
    assert not t(16, 2, 0, False) and t(16, 2, 0, False, True)


@pytest.mark.parametrize("H,fwd", [(16, False), (17, True), (128, True)])
@pytest.mark.parametrize("has_len", [False, True])
def test_gluon_forward_takes_the_v32_layout(monkeypatch, H, fwd, has_len):
    """D = 576 with d_v = 512 on an sm_90 GPU (stubbed): the Gluon forward from MIN_HEADS, with
    or without lengths, under every Triton (3.9's build reloads one spilled value a block
    loop: tests/test_sm90_compile.py); no other d_v < D."""
    from dsv4_sparse_attn.kernels import hopper

    monkeypatch.setattr(hopper, "not_sm90", lambda device: None)
    call = Call(torch.device("cuda", 0), torch.bfloat16, 576, H, True, 512, has_len)
    reason = forward_gluon.rejects(call)
    assert (reason is None) == fwd, reason
    for bad in (call._replace(d_v=0), call._replace(d_v=448), call._replace(D=640),
                call._replace(dtype=torch.float32)):
        assert forward_gluon.rejects(bad), bad


def test_gluon_forward_launcher_refuses_other_value_widths():
    with pytest.raises(ValueError, match="d_v = 448"):
        forward_gluon.sparse_mla_fwd(torch.zeros(1, 64, 512), torch.zeros(3, 512), torch.zeros(1, 4), None,
                                     1.0, d_v=448)


def test_cpu_tensors_never_take_a_kernel(fresh):
    q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    for direction in ("forward", "backward"):
        rows = dispatch.candidates(direction, Call.of(q))
        assert [n for n, m, r in rows if r is None] == ["reference"], rows
        assert all("cpu" in r for n, m, r in rows[:-1]), rows


def test_a_call_no_kernel_takes_runs_the_reference_with_a_warning(fresh, monkeypatch):
    monkeypatch.setattr(forward_gluon, "rejects", lambda call: "no")
    monkeypatch.setattr(forward_triton, "rejects", lambda call: "dtype torch.float32")
    with pytest.warns(RuntimeWarning, match="reference"):
        assert dispatch.choose("forward", Call.of(torch.zeros(1, 4, 64)))[0] == "reference"


def test_use_kernels_forces_a_kernel_and_says_why_it_cannot(fresh, monkeypatch):
    monkeypatch.setattr(forward_gluon, "rejects", lambda call: None)
    monkeypatch.setattr(forward_triton, "rejects", lambda call: None)
    call = Call.of(torch.zeros(1, 64, 512, dtype=torch.bfloat16))
    assert dispatch.choose("forward", call)[0] == "gluon_sm90"
    with dsv4_sparse_attn.use_kernels(forward="triton"):
        assert dispatch.choose("forward", call)[0] == "triton"
        with dsv4_sparse_attn.use_kernels(forward="reference"):
            assert dispatch.choose("forward", call)[0] == "reference"
        assert dispatch.choose("forward", call)[0] == "triton"
    assert dispatch.choose("forward", call)[0] == "gluon_sm90"
    monkeypatch.setattr(forward_triton, "rejects", lambda call: "head dim D=576")
    dispatch._choices.clear()  # (choices are remembered per call: the rules never change at run time)
    with dsv4_sparse_attn.use_kernels(forward="triton"), pytest.raises(ValueError, match="D=576"):
        dispatch.choose("forward", call)
    with pytest.raises(ValueError, match="no backward kernel named 'cudnn'"):
        with dsv4_sparse_attn.use_kernels(backward="cudnn"):
            pass


def test_backward_mode_follows_torch_unless_set(fresh, monkeypatch):
    """Default: deterministic exactly under torch.use_deterministic_algorithms(True);
    set_deterministic_backward(True/False) overrides it, None restores the default."""
    seen = []
    monkeypatch.setattr(backward_gluon, "rejects", lambda call: None)
    monkeypatch.setattr(kbwd, "sparse_mla_bwd", lambda *a, deterministic, **k: seen.append(deterministic))
    prev = torch.are_deterministic_algorithms_enabled()
    try:
        dsv4_sparse_attn.set_deterministic_backward(None)
        torch.use_deterministic_algorithms(False)
        _backward()
        torch.use_deterministic_algorithms(True)
        _backward()
        dsv4_sparse_attn.set_deterministic_backward(False)
        _backward()
        torch.use_deterministic_algorithms(False)
        dsv4_sparse_attn.set_deterministic_backward(True)
        _backward()
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)
        torch.use_deterministic_algorithms(prev)
    assert seen == [False, True, False, True]
    with pytest.raises(TypeError):
        dsv4_sparse_attn.set_deterministic_backward(1)


def test_python_m_report_runs_on_cpu(capsys):
    from dsv4_sparse_attn.__main__ import main

    main(["--device", "cpu"])
    out = capsys.readouterr().out
    assert "torch " + torch.__version__ in out and "triton " + triton.__version__ in out
    assert "reference" in out


@pytest.mark.parametrize("empty", ["T", "H", "K", "N"])
def test_calls_with_no_work_launch_no_kernel(every_kernel_takes, monkeypatch, empty):
    """T, H, K or N = 0: the reference's constants, no kernel launched (the Gluon kernels'
    persistent grids and the deterministic reduction have nothing to do)."""
    calls = _stub_backward(monkeypatch, None)
    sizes = dict(T=2, H=P.H, N=3, K=4)
    sizes[empty] = 0
    q = torch.randn(sizes["T"], sizes["H"], P.D, dtype=torch.bfloat16)
    kv = torch.randn(sizes["N"], P.D, dtype=torch.bfloat16)
    idx = torch.zeros(sizes["T"], sizes["K"], dtype=torch.int32)
    sink = torch.randn(sizes["H"])
    p = SimpleNamespace(**sizes, D=P.D, d_v=P.D, has_len=False, scale=P.scale)
    out, lse = dispatch.forward(q, kv, idx, sink, p)
    assert torch.equal(out, torch.zeros_like(out))
    if empty in ("K", "N"):
        assert torch.equal(lse, sink.expand_as(lse))
    grads = dispatch.backward(torch.randn_like(out), None, q, kv, out, lse, idx, sink, p)
    assert [g.shape for g in grads[:2]] == [q.shape, kv.shape] and calls == []


@pytest.mark.parametrize("D, d_v, takes", [(576, 512, True), (192, 128, True), (512, 512, True),
                                           (576, 500, False), (512, 448, False), (576, 256, False)])
def test_triton_takes_values_narrower_than_keys_by_64_columns(D, d_v, takes):
    call = Call(torch.device("cuda"), torch.bfloat16, D, 64, True, 0 if d_v == D else d_v)
    assert (forward_triton.rejects(call) is None) == takes
    assert (backward_triton.rejects(call) is None) == takes


def test_python_m_report_lists_lengths_and_the_v32_layout(fresh, monkeypatch):
    """The CUDA table (on an sm_90 GPU, faked): the Gluon kernels take a topk_length at
    D = 512 (the forward from 17 heads, as without lengths); the Gluon backward takes the
    576/512 layout, the Gluon forward from 17 heads;
    otherwise for d_v < D they step aside for Triton's and say why; D = 576 with d_v = D
    runs the reference."""
    from dsv4_sparse_attn import __main__ as cli
    from dsv4_sparse_attn.kernels import hopper

    monkeypatch.setattr(hopper, "not_sm90", lambda device: None)
    props = SimpleNamespace(name="H200", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    lines = cli.report(torch.device("cuda", 0)).splitlines()
    special = [line for line in lines if "576/512" in line or "+len" in line]
    assert len(special) == 2 * 3 * 3  # (576/512, 512 +len) x 3 ops x 3 head ranges
    for line in special:
        if "+len" in line and not ("fwd" in line and " 1-16 " in line):
            assert " gluon_sm90 " in line, line
        elif "576/512" in line and "bwd" in line:
            assert " gluon_sm90 " in line, line  # the Gluon backward takes 576/512
        elif "576/512" in line and "fwd" in line and " 1-16 " not in line:
            assert " gluon_sm90 " in line, line  # the Gluon forward takes 576/512 from 17 heads
        else:
            assert " triton " in line and "gluon_sm90:" in line, line
    plain_576 = [line for line in lines if " 576 " in line[:32]]  # the D column, d_v = D
    assert len(plain_576) == 3 * 3 and all(" reference " in line for line in plain_576), plain_576


def test_python_m_report_says_which_backward_options_this_triton_runs(fresh, monkeypatch):
    """The CUDA report names the Gluon backward's schedule options that are on under this
    Triton, and says so when some of those measured fastest are off."""
    from dsv4_sparse_attn import __main__ as cli
    from dsv4_sparse_attn.kernels import hopper

    monkeypatch.setattr(hopper, "not_sm90", lambda device: None)
    props = SimpleNamespace(name="H200", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    three_six = (("SPLIT_ROLES", 2), ("DQ_TMA", 1), ("QD_TMA_MAX_K", 256), ("SMALL_H_TRANSPOSED", True))
    for name, value in three_six:
        monkeypatch.setattr(backward_gluon, name, value)
    line, = [x for x in cli.report(torch.device("cuda", 0)).splitlines() if x.startswith("Gluon backward")]
    assert f"triton {triton.__version__}" in line and "dQ by TMA on" in line, line
    assert "all of the options" in line, line
    monkeypatch.setattr(backward_gluon, "DQ_TMA", 0)
    monkeypatch.setattr(backward_gluon, "SPLIT_ROLES", 0)  # (the transposed tiles need split roles)
    line, = [x for x in cli.report(torch.device("cuda", 0)).splitlines() if x.startswith("Gluon backward")]
    assert "dQ by TMA off" in line and "transposed tiles at H <= 32 off" in line and "not timed" in line, line
    assert "q and dO by TMA at K <= 256 on" in line, line


def test_gluon_backward_loads_q_and_do_by_tma_only_where_tma_can_address_them():
    """``backward_gluon.QD_TMA`` loads [1, 64, 128] tiles of q and dO ([T, H, D]) by TMA: any
    H (heads past H come in as zeros) and any token and head strides, but the last dim must
    be contiguous and the base and strides 16-byte aligned; anything else keeps cp.async."""
    ok = backward_gluon._tma_ok
    assert ok(torch.zeros(3, 128, 512, dtype=torch.bfloat16))
    assert ok(torch.zeros(3, 16, 512, dtype=torch.bfloat16))  # H < 64: the tile's other heads are zeros
    assert ok(torch.zeros(3, 64, 2, 512, dtype=torch.bfloat16)[:, :, 0])  # strided heads
    assert ok(torch.zeros(3, 130, 512, dtype=torch.bfloat16)[:, :128])  # token stride != H x head stride
    assert not ok(torch.zeros(512, 128, 3, dtype=torch.bfloat16).permute(2, 1, 0))  # D not contiguous
    assert not ok(torch.zeros(3 * 128 * 512 + 1, dtype=torch.bfloat16)[1:].view(3, 128, 512))  # misaligned
    assert not ok(torch.zeros(3, 64, 516, dtype=torch.bfloat16)[:, :, :512])  # head stride 1032 bytes
    # the descriptor: [T, H, D] with its token and head strides, [1, 64, 128] tiles
    q = torch.zeros(3, 2, 16, 512, dtype=torch.bfloat16)[:, 0]  # token stride 2 x 16 x 512
    d = backward_gluon._qd_descriptor(q)
    assert (list(d.shape), list(d.strides)) == ([3, 16, 512], [16384, 512, 1])
    assert list(d.block_shape) == [1, 64, 128]


def test_gluon_backward_releases_q_and_do_early_only_with_tma_and_split_roles(monkeypatch):
    """``backward_gluon.QD_EARLY`` (2 or 3 D quarters released by the last block's owner) needs
    the TMA loads (their bytes complete the barrier, whatever quarter lands last) and a split
    schedule (one consumer forms the last block's dKV rows); anywhere else it is off."""
    loads = backward_gluon._qd_loads
    q = torch.zeros(3, 64, 512, dtype=torch.bfloat16)
    strided = torch.zeros(512, 64, 3, dtype=torch.bfloat16).permute(2, 1, 0)  # D not contiguous: no TMA
    monkeypatch.setattr(backward_gluon, "QD_TMA_MAX_K", 256)  # (what Triton 3.6 takes)
    assert loads(q, q, 0, 2, 256) == (True, 2)  # the defaults: short rows by TMA, 2 quarters early
    assert loads(q, q, 0, 2, 257) == (False, 0)
    assert loads(q, q, 0, 0, 128) == (True, 0)  # unsplit schedule (the deterministic default)
    assert loads(q, q, 0, 2, 640, qd_tma=True) == (True, 2)
    assert loads(q, q, 0, 2, 128, qd_tma=False) == (False, 0)
    assert loads(q, q, 0, 2, 640, qd_tma=True, qd_early=3) == (True, 3)
    assert loads(q, q, 0, 1, 640, qd_tma=True, qd_early=0) == (True, 0)
    assert loads(q, q, 0, 0, 640, qd_tma=True, qd_early=3) == (True, 0)  # unsplit schedule
    assert loads(q, strided, 0, 2, 128, qd_tma=True, qd_early=3) == (False, 0)  # cp.async
    assert loads(q, q, 64, 0, 128, qd_tma=True, qd_early=3) == (False, 0)  # the 576/512 layout
    monkeypatch.setattr(backward_gluon, "QD_TMA", True)
    monkeypatch.setattr(backward_gluon, "QD_EARLY", 3)
    assert loads(q, q, 0, 2, 1152) == (True, 3)
    monkeypatch.setattr(backward_gluon, "QD_TMA_MAX_K", -1)  # other Tritons: cp.async unless asked
    monkeypatch.setattr(backward_gluon, "QD_TMA", None)
    assert loads(q, q, 0, 2, 128) == (False, 0)
    for bad in (1, 4):
        with pytest.raises(ValueError, match="qd_early"):
            loads(q, q, 0, 2, 640, qd_tma=True, qd_early=bad)


def test_packed_word_prototype_only_where_asked():
    """``launch(ablate=64)`` selects the packed-word reductions (RED 4; 5 with 128,
    unconverted), ``ablate=256`` the grid-rounded fp32 lines (6), in the fast mode only;
    the deterministic mode and every other ablation keep ``red_mode``'s reductions."""
    from dsv4_sparse_attn.kernels import hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    from dsv4_sparse_attn.kernels import backward_gluon as G

    assert G._red(False, None, 64) == 4 and G._red(False, True, 64 | 128) == 5
    assert G._red(True, None, 64) == G._red(True, None, 64 | 128) == 0
    assert G._red(False, None, 256) == G._red(False, False, 256) == 6 and G._red(True, None, 256) == 0
    for ablate in (0, 8, 128):
        for lines in (None, False, True):
            assert G._red(False, lines, ablate) == G.red_mode(False, lines)


def test_exact_sums_only_where_asked_and_built(monkeypatch):
    """The deterministic mode's exact two-word sums (a measurement option): off by default;
    asked for, taken where the main kernel has them (Triton at every width, Gluon at D = d_v
    = 512: ``exact_sums_ok``) and refused elsewhere with the widths named, by the backward and
    by the Gluon launcher itself (before any launch); ``exact_codes`` selects RED 7; the fast
    mode refuses it."""
    from dsv4_sparse_attn.kernels import hopper

    q512, do512 = torch.zeros(2, 64, 512), torch.zeros(2, 64, 512)
    q576 = torch.zeros(2, 64, 576)
    assert kbwd.EXACT_SUMS is False
    assert not kbwd.exact_sums_apply(backward_triton, q512, do512)
    assert kbwd.exact_sums_apply(backward_triton, q576, do512, True)
    assert not kbwd.exact_sums_apply(backward_triton, q576, do512, False)
    monkeypatch.setattr(kbwd, "EXACT_SUMS", True)
    assert kbwd.exact_sums_apply(backward_triton, q576, do512)
    assert not kbwd.exact_sums_apply(backward_gluon, q576, do512)  # (not built there: the fold)
    assert kbwd.exact_sums_apply(backward_gluon, q512, do512)
    with pytest.raises(ValueError, match="D = 576, d_v = 512"):
        kbwd.exact_sums_apply(backward_gluon, q576, do512, True)
    lse, ids = torch.zeros(2, 64), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="fast mode got exact=True"):  # (not dropped silently)
        kbwd.sparse_mla_bwd(do512, lse, q512, torch.zeros(3, 512), do512, lse, ids, None, 1.0,
                            backward_triton, deterministic=False, exact=True)
    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    assert backward_gluon._red(False, None, 0, True) == backward_gluon._red(True, None, 256, True) == 7
    kv, idx = torch.zeros(3, 576), torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="got D = 576, d_v = 512"):
        backward_gluon.launch(q576, kv, idx, do512, torch.zeros(2, 64), torch.zeros(2, 64), q576,
                              torch.zeros(3, 1024), None, None, 0, 2, 1.0, 1.0, False,
                              exact_codes=torch.zeros(3, dtype=torch.int32))


def test_kernels_launch_with_the_tensors_gpu_current(monkeypatch):
    """Triton launches on the current GPU's current stream, and a torch.library kernel is
    entered without a device guard: ``_run`` runs the kernel inside
    ``dispatch.on_device(call.device)`` (``torch.cuda.device`` for a CUDA device), the
    reference outside it, and both directions describe the call by q's device."""
    import contextlib

    from dsv4_sparse_attn.kernels.common import Call
    from dsv4_sparse_attn.validation import check_backward, check_forward

    assert dispatch.on_device(torch.device("cuda", 1)).idx == 1  # (built without touching a GPU)
    assert isinstance(dispatch.on_device(torch.device("cpu")), contextlib.nullcontext)

    inside = []

    @contextlib.contextmanager
    def recorded(device):
        inside.append(device)
        yield
        inside.pop()

    monkeypatch.setattr(dispatch, "on_device", recorded)
    call = Call(torch.device("cuda", 1), torch.bfloat16, 512, 64)
    monkeypatch.setattr(dispatch, "choose", lambda direction, call: ("triton", backward_triton))
    assert dispatch._run("backward", call, lambda mod: list(inside), None) == [call.device]
    monkeypatch.setattr(dispatch, "choose", lambda direction, call: (dispatch.REFERENCE, None))
    assert dispatch._run("backward", call, None, lambda: list(inside)) == []
    assert not inside

    monkeypatch.setattr(dispatch, "_run", lambda direction, call, *_: (direction, call.device))
    q, kv = torch.randn(3, 2, 8), torch.randn(5, 8)
    idx = torch.zeros(3, 4, dtype=torch.int32)
    out, lse = torch.zeros(3, 2, 8), torch.zeros(3, 2)
    p = check_forward(q, kv, idx, None, None)
    assert dispatch.forward(q, kv, idx, None, p) == ("forward", q.device)
    p = check_backward(out, None, q, kv, out, lse, idx, None, None)
    assert dispatch.backward(out, None, q, kv, out, lse, idx, None, p) == ("backward", q.device)


def test_kernels_allocate_without_the_deterministic_fill(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) PyTorch NaN-fills every empty tensor;
    the kernels write all they read, so the fill is off while they run (not while the
    reference runs) and restored after, also when the kernel raises."""
    seen = {}

    def kernel(mod):
        seen["kernel"] = torch.utils.deterministic.fill_uninitialized_memory
        if seen.get("raise"):
            raise RuntimeError("out of memory")
        return "kernel"

    from dsv4_sparse_attn.kernels.common import Call

    call = Call(torch.device("cpu"), torch.bfloat16, 512, 64)
    triton_first = lambda direction, call: ("triton", backward_triton)  # noqa: E731
    monkeypatch.setattr(dispatch, "choose", triton_first)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        assert dispatch._run("backward", call, kernel, None) == "kernel"
        assert seen["kernel"] is False and torch.utils.deterministic.fill_uninitialized_memory
        seen["raise"] = True
        with pytest.raises(RuntimeError, match="out of memory"):
            dispatch._run("backward", call, kernel, None)
        assert torch.utils.deterministic.fill_uninitialized_memory
        monkeypatch.setattr(dispatch, "choose", lambda direction, call: (dispatch.REFERENCE, None))
        assert dispatch._run("backward", call, None,
                             lambda: torch.utils.deterministic.fill_uninitialized_memory) is True
    finally:
        torch.use_deterministic_algorithms(prev)
    monkeypatch.setattr(dispatch, "choose", triton_first)
    seen.clear()
    dispatch._run("backward", call, kernel, None)
    assert seen["kernel"] is True  # (deterministic algorithms off: the flag is left alone)


def test_aligned16_copies_only_what_the_gluon_gathers_cannot_take():
    """``common.aligned16``: the tensor itself where the base is 16-byte aligned and every
    stride but the last a multiple of 16 elements (expanded dims included); else a
    contiguous copy with the same values."""
    from dsv4_sparse_attn.kernels.common import aligned16

    x = torch.randn(4, 3, 64, dtype=torch.bfloat16)
    assert aligned16(x) is x and aligned16(None) is None
    e = torch.randn(64, dtype=torch.bfloat16).expand(4, 3, 64)  # strides (0, 0, 1)
    assert aligned16(e) is e
    off = torch.randn(1 + 4 * 3 * 64, dtype=torch.bfloat16)[1:].view(4, 3, 64)  # 2 bytes off
    wide = torch.randn(4, 3, 72, dtype=torch.bfloat16)[..., :64]  # rows 72 elements apart
    tcol = torch.randn(64, 4, 3, dtype=torch.bfloat16).permute(1, 2, 0)  # last dim strided
    for bad in (off, wide, tcol):
        y = aligned16(bad)
        assert y is not bad and torch.equal(y, bad) and y.is_contiguous() and y.data_ptr() % 16 == 0


def test_gluon_forward_gathers_from_aligned_rows(monkeypatch):
    """The Gluon forward hands its kernel q and kv through ``aligned16`` (a launch with an
    unaligned base or stride would not compile, and the failed build would drop the Gluon
    forward for the process)."""
    import types

    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def run(q, kv, *args, **kwargs):
                seen["ok"] = [x.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in x.stride()[:-1])
                              for x in (q, kv)]
            return run

    monkeypatch.setattr(forward_gluon, "_sparse_mla_fwd_gluon_kernel", Kernel())
    monkeypatch.setattr(forward_gluon, "cuda_properties",
                        lambda d: types.SimpleNamespace(multi_processor_count=4))
    # (the trailing-slots option's lengths launch needs a GPU; this test is about the rows)
    monkeypatch.setattr(forward_gluon, "TRAILING_MASKED_SKIPPED", False)
    q = torch.randn(3, 64, 520, dtype=torch.bfloat16)[..., :512]  # heads 520 elements apart
    kv = torch.randn(1 + 6 * 512, dtype=torch.bfloat16)[1:].view(6, 512)  # 2 bytes off
    forward_gluon.sparse_mla_fwd(q, kv, torch.zeros(3, 8, dtype=torch.int32), None, 1.0)
    assert seen["ok"] == [True, True]


def test_gluon_backward_lengths_in_token_order_take_no_schedule(monkeypatch):
    """``launch(in_order=True)`` (the trailing-slots option's lengths): the tokens in their
    order, so it refuses a chunk's ``tokens`` or ``order`` (a schedule it would not read),
    before anything is built or launched."""
    from dsv4_sparse_attn.kernels import hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    monkeypatch.setattr(backward_gluon, "program_count", lambda n_tiles, device, paired: 1)
    q = torch.zeros(3, 64, 512, dtype=torch.bfloat16)
    kv, idx = torch.zeros(10, 512, dtype=torch.bfloat16), torch.zeros(3, 64, dtype=torch.int32)
    lengths = torch.full((3,), 64, dtype=torch.int32)
    given = (dict(tokens=torch.arange(3, dtype=torch.int32)),
             dict(order=torch.zeros(3, 2, dtype=torch.int32)))
    for extra in given:
        with pytest.raises(ValueError, match="in_order"):
            backward_gluon.launch(q, kv, idx, q, None, None, q, None, None, None, 0, 3, 1.0, 1.0, False,
                                  topk_length=lengths, in_order=True, **extra)


def test_gluon_backward_chained_launch_checks_its_counters_and_layout():
    """``launch(chain=...)`` (``backward.FOLD_CHAIN``): refused without the rows at their ranks
    and with counters that are not int32 (the kernel tells a chained build by their dtype),
    before anything is launched."""
    from dsv4_sparse_attn.kernels import hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    n_tok, K = 2, 64
    q = torch.zeros(n_tok, 64, 512, dtype=torch.bfloat16)
    kv, idx = torch.zeros(10, 512, dtype=torch.bfloat16), torch.zeros(n_tok, K, dtype=torch.int32)
    acc = torch.zeros(10, 512)
    part = torch.zeros(n_tok * K + 1, 512, dtype=torch.float16)
    pexp = torch.zeros(n_tok * K + 1, dtype=torch.int64)
    ranks = torch.zeros(n_tok * K, dtype=torch.int32)
    common = (q, kv, idx, q, None, None, q, acc, part, None, 0, n_tok, 1.0, 1.0, False)
    for sync, extra, match in ((torch.zeros(6, dtype=torch.int32), {}, "chained launches"),
                               (torch.zeros(6), dict(ranks=ranks), "int32 counters")):
        with pytest.raises(ValueError, match=match):
            backward_gluon.launch(*common, partial_exp=pexp, programs=1, split=0,
                                  chain=(sync, 0, 0, 0, 0, False), **extra)


@pytest.mark.parametrize("H,n_tok,launches", [
    (64, 9, [(0, 8, 2, False, 8, 8, 1), (8, 1, False, True, 4, 0, 4)]),  # 10 blocks: 4 parts
    (128, 5, [(0, 4, 2, False, 8, 8, 1), (4, 1, False, True, 4, 0, 2)]),  # two head blocks
    (64, 8, [(0, 8, 2, False, 8, 8, 1)]),  # whole rounds: one launch
])
def test_gluon_backward_lengths_in_token_order_leave_the_remainder_to_parts(monkeypatch, H, n_tok, launches):
    """``launch(in_order=True)`` in the fast mode: the whole rounds of programs take the
    lengths, the tiles past them a launch of their own on every program, without lengths,
    cut into parts (the lengths' build has none), with a ticket of its own; their dQ parts go
    to the caller's list. Each launch: (t_begin, tokens, HAS_LEN, PARTS, units, whole tiles,
    parts a tile)."""
    from dsv4_sparse_attn.kernels import hopper

    if hopper.gluon_unavailable():
        pytest.skip(f"no Gluon in this Triton: {hopper.gluon_unavailable()}")
    seen = []
    names = backward_gluon._bwd_main_gluon_kernel.arg_names  # (the launch's arguments by name)

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **kw):
                a = dict(zip(names, args))
                seen.append(dict(grid=grid, flags=a["FLAGS"].data_ptr(), t_begin=a["t_begin"],
                                 n_tiles=a["n_tiles"], units=(a["n_units"], a["n_full"], a["n_parts"]),
                                 HAS_LEN=kw["HAS_LEN"], PARTS=kw["PARTS"], PDL=kw["PDL"],
                                 launch_pdl=kw.get("launch_pdl", False)))
            return run

    monkeypatch.setattr(backward_gluon, "_bwd_main_gluon_kernel", Kernel())
    monkeypatch.setattr(backward_gluon, "program_count", lambda n_tiles, device, paired: min(n_tiles, 4))
    K = 640
    q = torch.zeros(n_tok, H, 512, dtype=torch.bfloat16)
    kv, idx = torch.zeros(10, 512, dtype=torch.bfloat16), torch.zeros(n_tok, K, dtype=torch.int32)
    flags = torch.zeros(backward_gluon.flags_per_chunk(n_tok, H // 64), dtype=torch.int32)
    jobs = []
    lse = torch.zeros(n_tok, H)
    backward_gluon.launch(q, kv, idx, q, lse, lse, q, torch.zeros(10, 512), None, flags, 0, n_tok, 1.0, 1.0,
                          False, topk_length=torch.full((n_tok,), K, dtype=torch.int32), in_order=True,
                          qd_tma=False, dq_tma=0, evict_last=False, split=1, dq_parts=jobs)
    got = [(r["t_begin"], r["n_tiles"] // (H // 64), r["HAS_LEN"], r["PARTS"], r["units"][0], r["units"][1],
            r["units"][2]) for r in seen]
    assert got == launches
    assert all(r["grid"] == (4,) for r in seen)
    assert len({r["flags"] for r in seen}) == len(seen)  # a zeroed ticket each
    assert [(j.t_begin, j.n_full, j.n_parts, j.n_rem) for j in jobs] == [
        (r[0], 0, r[6], r[1] * (H // 64)) for r in launches if r[3]]
    # (two launches: the parts' one a programmatic dependent launch, REMAINDER_PDL)
    pdl = [(1, False), (2, True)] if len(seen) == 2 else [(0, False)]
    assert [(r["PDL"], r["launch_pdl"]) for r in seen] == pdl


@pytest.mark.parametrize("option, given", [(True, False), (True, True), (False, False)])
def test_gluon_forward_trailing_option_takes_lengths_in_token_order(monkeypatch, option, given):
    """``forward_gluon.TRAILING_MASKED_SKIPPED``: without lengths the kernel gets each token's
    trailing length (``common.trailing_lengths``) as lengths in token order (``HAS_LEN`` 2,
    no balanced order, the dead odd block skipped); given lengths keep their balanced order
    (``HAS_LEN`` 1); off, no lengths."""
    import types

    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **kw):
                seen.update(LEN=args[-2], ORDER=args[-1], HAS_LEN=kw["HAS_LEN"], DEAD=kw["DEAD"])
            return run

    monkeypatch.setattr(forward_gluon, "_sparse_mla_fwd_gluon_kernel", Kernel())
    monkeypatch.setattr(forward_gluon, "cuda_properties",
                        lambda d: types.SimpleNamespace(multi_processor_count=4))
    monkeypatch.setattr(forward_gluon, "TRAILING_MASKED_SKIPPED", option)
    monkeypatch.setattr(forward_gluon, "trailing_lengths",
                        lambda idx, N: torch.tensor([3, 1, 0], dtype=torch.int32))
    monkeypatch.setattr(forward_gluon, "balanced_order",
                        lambda *a: torch.tensor([2, 0, 1], dtype=torch.int32))
    q = torch.randn(3, 64, 512, dtype=torch.bfloat16)
    kv, idx = torch.randn(6, 512, dtype=torch.bfloat16), torch.zeros(3, 256, dtype=torch.int32)
    lengths = torch.tensor([5, 6, 7], dtype=torch.int32) if given else None
    forward_gluon.sparse_mla_fwd(q, kv, idx, None, 1.0, topk_length=lengths)
    if given:
        assert seen["HAS_LEN"] is True and seen["LEN"] is lengths and seen["ORDER"].tolist() == [2, 0, 1]
    elif option:
        assert seen["HAS_LEN"] == 2 and seen["LEN"].tolist() == [3, 1, 0] and seen["ORDER"] is idx
        assert seen["DEAD"]
    else:  # (the default builds keep their bool constexpr: the same compiled kernels as before)
        assert seen["HAS_LEN"] is False and seen["LEN"] is idx and seen["ORDER"] is idx
    assert forward_gluon.TRAILING_MASKED_SKIPPED is option
