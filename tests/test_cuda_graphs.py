"""CUDA graphs: no host sync in forward + backward, whole-step capture and replay, and
torch.compile(mode="reduce-overhead") with its cudagraph trees. GPU only.

The block runs in bf16 so the GPU kernels (not the reference) are what is checked, in two
shapes: H=16, D=128 (the Triton forward) and H=64, D=512 (DeepSeek's head dim: the Gluon
forward on sm_90, the Triton one elsewhere). Both backward modes are covered: the
deterministic one (torch.sort + searchsorted on the device, no .item()) and the fast,
fp32-atomic one.
"""
from __future__ import annotations

import copy

import pytest
import torch

import dsv4_sparse_attn
from dsv4_sparse_attn import SparseMLAAttention
from helpers import causal_indices, relerr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (CUDA graphs, Triton kernels)"),
]

T, K, WINDOW = 256, 96, 32
DTYPE = torch.bfloat16
# (dim, H, D)
SHAPES = {"h16d128": (512, 16, 128), "h64d512": (1024, 64, 512)}


@pytest.fixture(params=[True, False], ids=["det", "atomic"])
def deterministic(request):
    dsv4_sparse_attn.set_deterministic_backward(request.param)
    yield request.param
    dsv4_sparse_attn.set_deterministic_backward(None)  # the default: follow torch


@pytest.fixture(params=list(SHAPES))
def shape(request):
    return SHAPES[request.param]


def _block(seed: int, shape=SHAPES["h16d128"]) -> SparseMLAAttention:
    dim, n_heads, head_dim = shape
    torch.manual_seed(seed)
    block = SparseMLAAttention(dim, n_heads, head_dim, bias=True, device="cuda", dtype=DTYPE)
    with torch.no_grad():
        block.attn_sink.normal_()
    return block


def _inputs(seed: int, shape=SHAPES["h16d128"]):
    dim = shape[0]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, dim, device="cuda", generator=g).to(DTYPE)
    idx = causal_indices((T,), K, WINDOW, device="cuda", generator=g)
    target = torch.randn(T, dim, device="cuda", generator=g)
    return x, idx, target


def _loss(y, lse, target):
    return (y.float() - target).square().mean() + 0.01 * lse.mean()


def _fwd_bwd(block, x, idx, target):
    block.zero_grad(set_to_none=True)
    y, lse = block(x, idx, return_lse=True)
    loss = _loss(y, lse, target)
    loss.backward()
    return y, lse, loss


def _grads(block):
    return {n: p.grad.detach().clone() for n, p in block.named_parameters()}


def test_forward_backward_without_host_sync(deterministic, shape):
    block = _block(0, shape)
    x, idx, target = _inputs(1, shape)
    _fwd_bwd(block, x, idx, target)  # warm-up: Triton compiles (and may sync) on the first call
    torch.cuda.synchronize()
    x2, idx2, target2 = _inputs(2, shape)
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        for _ in range(2):
            _, _, loss = _fwd_bwd(block, x2, idx2, target2)
    finally:
        torch.cuda.set_sync_debug_mode(old)
    torch.cuda.synchronize()
    assert torch.isfinite(loss).item()
    assert all(torch.isfinite(p.grad).all().item() for p in block.parameters())


def test_whole_step_capture_and_replay(deterministic, shape):
    """Forward + backward captured in one torch.cuda.CUDAGraph; replays on new inputs copied
    into the static buffers give eager's out, lse, loss and parameter gradients."""
    block = _block(3, shape)
    eager = copy.deepcopy(block)  # its own .grad tensors: the graph's live in the graph pool
    static_x, static_idx, static_target = _inputs(4, shape)

    # Warm up on a side stream (PyTorch docs, "Whole-network capture").
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            _fwd_bwd(block, static_x, static_idx, static_target)
    torch.cuda.current_stream().wait_stream(s)

    graph = torch.cuda.CUDAGraph()
    block.zero_grad(set_to_none=True)  # grads are allocated inside the graph's pool
    with torch.cuda.graph(graph):
        static_y, static_lse = block(static_x, static_idx, return_lse=True)
        static_loss = _loss(static_y, static_lse, static_target)
        static_loss.backward()

    for seed in (5, 6, 7):
        x, idx, target = _inputs(seed, shape)
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_target.copy_(target)
        graph.replay()
        y, lse, loss = _fwd_bwd(eager, x, idx, target)
        torch.cuda.synchronize()
        # Same kernels on the same values: bitwise in practice; 1e-3 leaves room for a
        # cuBLAS algorithm chosen differently under capture (and for the atomic backward).
        assert relerr(static_y, y) <= 1e-3, seed
        assert relerr(static_lse, lse) <= 1e-3, seed
        assert relerr(static_loss, loss) <= 1e-3, seed
        want = _grads(eager)
        got = _grads(block)
        assert got.keys() == want.keys()
        for name in want:
            assert relerr(got[name], want[name]) <= 1e-3, (seed, name)


def test_compile_reduce_overhead_uses_cudagraphs(deterministic):
    """torch.compile(mode="reduce-overhead"): forward and backward run as cudagraph trees,
    nothing is skipped, and out / lse / gradients match eager. (H=16, D=128.)"""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    block = _block(8)
    eager = copy.deepcopy(block)
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    # Recording happens on the later calls (the first ones warm up): run a few steps.
    for seed in range(9, 14):
        x, idx, target = _inputs(seed)
        torch.compiler.cudagraph_mark_step_begin()
        block.zero_grad(set_to_none=True)
        y, lse = compiled(x, idx, return_lse=True)
        # The outputs live in the cudagraph pool until the next replay: copy what we keep.
        y_c, lse_c = y.detach().clone(), lse.detach().clone()
        loss = _loss(y, lse, target)
        loss.backward()
        loss_c = loss.detach().clone()
        g_c = _grads(block)
        del y, lse, loss
        y_e, lse_e, loss_e = _fwd_bwd(eager, x, idx, target)
        g_e = _grads(eager)
        # bf16: inductor fuses the projections, bias adds and casts differently from eager.
        assert relerr(y_c, y_e) < 2e-2, seed
        assert relerr(lse_c, lse_e) < 2e-2, seed
        assert relerr(loss_c, loss_e) < 2e-2, seed
        for name in g_e:
            assert relerr(g_c[name], g_e[name]) < 2e-2, (seed, name)
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor skipped cudagraphs (see the log)"
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None, "no cudagraph tree manager: cudagraphs were not used"
    recorded = list(manager.get_roots())
    assert recorded, "cudagraph trees recorded no graph"
    torch._dynamo.reset()


def _replays_match_eager(step, static, inputs):
    """``step(static)`` (the ops' out, lse, grad_q, grad_kv and grad_sink) captured in a
    CUDA graph after a warm-up on a side stream; each of ``inputs`` ({seed: tensor}) copied
    into ``static`` and replayed gives what an eager ``step`` on it gives."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static)
    for seed, new in inputs.items():
        static.copy_(new)
        graph.replay()
        want = step(new)
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "lse", "grad_q", "grad_kv", "grad_sink"), static_out, want):
            assert relerr(a, b) <= 1e-3, (seed, name)


def _ops_step(Tn, H, D, N, seed):
    """``step(idx)``: the forward and backward ops on random q, kv, sink and grad_out (seed
    ``seed``) with ids ``idx``, returning out, lse and the three gradients."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(Tn, H, D, device="cuda", generator=g).to(DTYPE)
    kv = torch.randn(N, D, device="cuda", generator=g).to(DTYPE)
    sink = torch.randn(H, device="cuda", generator=g)
    do = torch.randn(Tn, H, D, device="cuda", generator=g).to(DTYPE)

    def step(idx):
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink)
        grads = torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink)
        return (out, lse) + tuple(grads)
    return step


def test_lengths_without_host_sync_and_under_capture(deterministic):
    """topk_length at D = 512 (the Gluon kernels on sm_90, with their length-ordered tile
    schedule): forward and backward ops with no host sync, and captured in a CUDA graph
    whose replays with new lengths in the static buffer match eager calls."""
    Tn, H, D, N, Kn = 300, 64, 512, 400, 256
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(Tn, H, D, device="cuda", generator=g).to(DTYPE)
    kv = torch.randn(N, D, device="cuda", generator=g).to(DTYPE)
    idx = torch.randint(-1, N, (Tn, Kn), device="cuda", generator=g, dtype=torch.int32)
    sink = torch.randn(H, device="cuda", generator=g)
    do = torch.randn(Tn, H, D, device="cuda", generator=g).to(DTYPE)
    length = torch.randint(0, Kn + 1, (Tn,), device="cuda", generator=g, dtype=torch.int32)

    def step(length):
        out, lse = torch.ops.dsv4.sparse_mla_fwd(q, kv, idx, sink, None, length)
        grads = torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, None, length)
        return (out, lse) + tuple(grads)

    step(length)  # warm-up: compiles
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(length)
    finally:
        torch.cuda.set_sync_debug_mode(old)

    _replays_match_eager(step, length.clone(), {
        seed: torch.randint(0, Kn + 1, (Tn,), device="cuda", dtype=torch.int32,
                            generator=torch.Generator(device="cuda").manual_seed(seed))
        for seed in (9, 10)})


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "after"])
def test_trailing_masked_slots_under_capture(monkeypatch, pdl):
    """Both trailing options on (off by default): the forward's lengths launch, and the fast
    backward's whole rounds with the lengths found by Delta followed by the remainder's parts
    launch, started early by programmatic dependent launch (``REMAINDER_PDL``) or after the
    whole rounds. Captured in a CUDA graph, replays with new ids in the static buffer match
    eager calls. (T = 300 at H = 64: on a GPU of 100-150 SMs, whole rounds and a remainder.)"""
    from dsv4_sparse_attn.kernels import backward as kbwd
    from dsv4_sparse_attn.kernels import backward_gluon, forward_gluon

    monkeypatch.setattr(kbwd, "TRAILING_MASKED_SKIPPED", True)
    monkeypatch.setattr(forward_gluon, "TRAILING_MASKED_SKIPPED", True)
    monkeypatch.setattr(backward_gluon, "REMAINDER_PDL", pdl)
    dsv4_sparse_attn.set_deterministic_backward(False)
    try:
        Tn, N, Kn = 300, 400, 256
        step = _ops_step(Tn, 64, 512, N, seed=11)

        def ids(seed):  # each token's ids valid up to a cut of its own, -1 after it
            gen = torch.Generator(device="cuda").manual_seed(seed)
            idx = torch.randint(0, N, (Tn, Kn), device="cuda", generator=gen, dtype=torch.int32)
            cut = torch.randint(0, Kn + 1, (Tn, 1), device="cuda", generator=gen)
            return torch.where(torch.arange(Kn, device="cuda") < cut, idx, -1).to(torch.int32)

        _replays_match_eager(step, ids(12), {seed: ids(seed) for seed in (13, 14)})
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)


def test_deterministic_groups_beside_under_capture(monkeypatch):
    """The deterministic backward in chunks and sort groups, each group's id inversion on
    the second stream (``SORT_BESIDE``): captured in a CUDA graph (the side stream forked
    from and joined to the captured one), replays with new ids in the static buffer match
    eager calls."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    Tn, H, D, N, Kn = 200, 64, 512, 400, 128
    monkeypatch.setattr(kbwd, "PARTIAL_BYTES", 40 * Kn * D * 4)  # chunks of 40-80 tokens
    monkeypatch.setattr(kbwd, "SORT_ENTRIES", 2 * 40 * Kn)  # groups of one or two chunks
    assert kbwd.SORT_BESIDE
    dsv4_sparse_attn.set_deterministic_backward(True)
    try:
        step = _ops_step(Tn, H, D, N, seed=15)

        def ids(seed):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            return torch.randint(-1, N, (Tn, Kn), device="cuda", generator=gen, dtype=torch.int32)

        _replays_match_eager(step, ids(16), {seed: ids(seed) for seed in (17, 18)})
    finally:
        dsv4_sparse_attn.set_deterministic_backward(None)
