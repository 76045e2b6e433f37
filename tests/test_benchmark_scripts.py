"""benchmarks/: the scripts import, parse their options and, without a GPU, exit with a
message rather than a traceback; they import nothing of the package but its public API.

They only run on the GPU, where runs are rare, so a renamed function or a broken
import would otherwise surface there, costing device time.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
SCRIPTS = ["bench.py", "report.py", "heads_sweep.py", "profile_bwd.py", "sanitize_case.py",
           "fsdp_step_time.py", "features_bench.py", "triton_cache.py"]
GPU_ONLY = ["bench.py", "heads_sweep.py", "profile_bwd.py", "sanitize_case.py", "features_bench.py"]
# What the scripts may import: the standard library, torch, triton, matplotlib, each other,
# and of the package its public modules (dispatch and Call: only to name the kernel that ran).
PUBLIC = {"dsv4_sparse_attn", "dsv4_sparse_attn.testing", "dsv4_sparse_attn.kernels.dispatch",
          "dsv4_sparse_attn.kernels.common"}
THIRD_PARTY = {"torch", "triton", "matplotlib"}


def run(script, *args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    return subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_no_other_scripts():
    """A new script gets listed here (and so checked)."""
    assert sorted(f for f in os.listdir(BENCHMARKS) if f.endswith(".py")) == sorted(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_starts(script):
    r = run(script, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:500]


def _allowed(module: str, name: str | None) -> bool:
    """Whether ``import module`` (name None) or ``from module import name`` keeps to the
    package's public API."""
    if name is None:
        return module in PUBLIC
    if module == "dsv4_sparse_attn":
        import dsv4_sparse_attn
        return name in dsv4_sparse_attn.__all__ or name in ("testing", "__version__")
    return module in PUBLIC or f"{module}.{name}" in PUBLIC


@pytest.mark.parametrize("script", SCRIPTS)
def test_imports_only_the_public_api(script):
    tree = ast.parse(open(os.path.join(BENCHMARKS, script)).read())
    siblings = {s[:-3] for s in SCRIPTS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in imports:
            top = module.split(".")[0]
            if top == "dsv4_sparse_attn":
                assert _allowed(module, name), f"{script}: {module} {name}: benchmarks use the public API"
            else:
                assert (top in sys.stdlib_module_names or top in THIRD_PARTY or top in siblings
                        or top == "cudnn_peer"), f"{script} imports {module}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
@pytest.mark.parametrize("script", GPU_ONLY)
def test_without_a_gpu(script):
    r = run(script)
    assert r.returncode == 1 and "needs a CUDA GPU" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr


def test_best_of_ab_gives_every_arm_an_early_and_a_late_place():
    """The experiments' A/B timing (``side_by_side.best_of_ab``) alternates the passes'
    direction, so no arm is always first or always last (cuDNN's arm is added last), and
    keeps each arm's best time."""
    sys.path.insert(0, os.path.join(BENCHMARKS, "experiments"))
    try:
        import side_by_side
    finally:
        sys.path.remove(os.path.join(BENCHMARKS, "experiments"))
    order = []
    fns = {name: name for name in "abc"}
    times = iter([3.0, 2.0, 1.0, 4.0, 5.0, 0.5])

    def timer(fn):
        order.append(fn)
        return next(times)
    got = side_by_side.best_of_ab(fns, reps=2, timer=timer)
    assert order == ["a", "b", "c", "c", "b", "a"]
    assert got == {"a": 0.5, "b": 2.0, "c": 1.0}


def test_with_flags_sets_a_modules_options_for_the_call_only():
    """``side_by_side.with_flags`` (an option arm of the experiments): the module's attributes
    hold the given values while the call runs, and their old values after it, also when the
    call raises."""
    import types

    sys.path.insert(0, os.path.join(BENCHMARKS, "experiments"))
    try:
        import side_by_side
    finally:
        sys.path.remove(os.path.join(BENCHMARKS, "experiments"))
    m = types.SimpleNamespace(A=1, B="x")
    seen = []
    arm = side_by_side.with_flags(m, lambda k: seen.append((m.A, m.B, k)) or k + 1, A=2, B="y")
    assert arm(5) == 6 and seen == [(2, "y", 5)] and (m.A, m.B) == (1, "x")

    def fails():
        raise RuntimeError(m.A)
    with pytest.raises(RuntimeError, match="3"):
        side_by_side.with_flags(m, fails, A=3)()
    assert (m.A, m.B) == (1, "x")


def test_pool_inputs_are_the_long_context_rows_inputs():
    """``side_by_side.pool_inputs`` (the L2 experiments' tensors): T raw rows then
    max(T // 4, K) pool rows; causal pool ids below T + t // 4 or -1; the same tensors
    for the same arguments; out and lse from the forward (CPU: the reference)."""
    sys.path.insert(0, os.path.join(BENCHMARKS, "experiments"))
    try:
        import side_by_side
    finally:
        sys.path.remove(os.path.join(BENCHMARKS, "experiments"))
    T, H, K, D = 64, 2, 160, 16  # (a window of 128, then 32 pool slots)
    q, kv, idx, sink, do, out, lse = side_by_side.pool_inputs(T, H, K, "causal", D=D, dev="cpu")
    assert q.shape == (T, H, D) and kv.shape == (T + K, D) and idx.shape == (T, K)
    assert do.shape == out.shape == (T, H, D) and lse.shape == (T, H) and sink.shape == (H,)
    pool = idx[:, 128:].long()
    t = torch.arange(T)[:, None]
    assert bool(((pool == -1) | ((pool >= T) & (pool < T + t // 4))).all())
    again = side_by_side.pool_inputs(T, H, K, "causal", D=D, dev="cpu")
    assert all(torch.equal(a, b) for a, b in zip((q, kv, idx, do), (again[0], again[1], again[2], again[4])))


def _bench_module():
    """benchmarks/bench.py loaded afresh as a module (for its functions, on the CPU)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_under_test", os.path.join(BENCHMARKS, "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.filterwarnings("ignore:dsv4.sparse_mla")  # (the kernel's name looked up for CPU tensors)
def test_backward_sweep_times_ours_and_cudnn_in_both_orders(monkeypatch):
    """``bench.py --backward-sweep``'s row: our two modes, plain PyTorch and cuDNN's backward
    timed twice, the second pass in reverse order (cuDNN first), each keeping its better time (an arm's
    place in a pass moved one build's time by up to 5.6%). Run on the CPU with the timer,
    the inputs' device and the memory reading replaced, and a stand-in peer."""
    bench = _bench_module()
    order, times = [], iter([5.0, 6.0, 9.0, 7.0, 3.0, 8.0, 6.5, 4.0])

    def timer(fn, warmup=0, rep=0):
        fn()
        mode = "det" if bench.dispatch.deterministic_backward() else "fast"
        order.append("torch" if "torch_bwd" in fn.__qualname__ else getattr(fn, "arm", None) or mode)
        return next(times)
    make_inputs = bench.make_inputs
    monkeypatch.setattr(bench, "make_inputs", lambda *a, **k: make_inputs(*a, **{**k, "dev": "cpu"}))
    monkeypatch.setattr(bench, "bench", timer)
    monkeypatch.setattr(bench, "peak_extra", lambda fn, keep=0: 0)

    class Peer:
        @staticmethod
        def make_bwd(q, kv, idx, sink, scale, out, lse, do):
            def f():
                dq, dkv, dsink = torch.ops.dsv4.sparse_mla_bwd(do, None, q, kv, out, lse, idx, sink, scale)
                return dq, dkv, dsink
            f.arm = "cudnn"
            return f
    row = bench.sweep_row(8, 2, 16, "random", 64, (0, 0), Peer(), with_torch=True)
    assert order == ["fast", "det", "torch", "cudnn", "cudnn", "torch", "det", "fast"], order
    assert row["fast"]["ms_passes"] == [5.0, 4.0] and row["fast"]["ms"] == 4.0
    assert row["deterministic"]["ms_passes"] == [6.0, 6.5] and row["deterministic"]["ms"] == 6.0
    assert row["cudnn"]["ms_passes"] == [7.0, 3.0] and row["cudnn"]["ms"] == 3.0
    assert row["torch"]["ms_passes"] == [9.0, 8.0] and row["torch"]["ms"] == 8.0
    assert row["cudnn"]["kernel"] is None  # (a stand-in peer names no kernel)
    assert row["speedups"]["fast_vs_cudnn"] == 3.0 / 4.0
    assert abs(row["cudnn"]["cos_dkv"]["fast"] - 1) < 1e-6


def test_plain_pytorch_baseline_matches_the_oracle():
    """bench.py's plain PyTorch arm computes the op (masked, out-of-range and causal -1 ids,
    the sink) in forward and backward: float64 against the reference (its softmax runs in
    fp32, hence 1e-6)."""
    bench = _bench_module()
    from dsv4_sparse_attn.testing import deepseek_indices, oracle_bwd, oracle_fwd

    T, H, D, N, K = 40, 4, 64, 60, 32
    g = torch.Generator().manual_seed(3)
    q, kv = torch.randn(T, H, D, generator=g).double(), torch.randn(N, D, generator=g).double()
    sink = torch.randn(H, generator=g).double()
    idx = deepseek_indices(T, K, n_pool=N - T, pool="causal", generator=g)
    idx[0, 3], idx[5, 7] = N + 5, -7
    qg, kvg, sg = (x.clone().requires_grad_() for x in (q, kv, sink))
    out, lse = bench.torch_sparse_mla(qg, kvg, idx, sg, D ** -0.5)
    ro, rl = oracle_fwd(q, kv, idx, sink)
    assert (out - ro).abs().max() < 1e-6 and (lse - rl).abs().max() < 1e-6
    do = torch.randn(out.shape, generator=g, dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, (qg, kvg, sg), do), oracle_bwd(do, None, q, kv, idx, sink)):
        assert (got - want).abs().max() < 1e-6


def test_bench_gives_slow_calls_five_flushed_samples(monkeypatch):
    """bench.py's ``bench``: a call that do_bench would sample fewer than MIN_SAMPLES times
    (slower than rep / MIN_SAMPLES) is the median of SLOW_CALLS event-timed calls, the L2
    flush buffer zeroed before each; a faster one goes to do_bench. CPU stand-ins for the
    events, the flush buffer and do_bench."""
    bench = _bench_module()
    ms = iter([])

    class Event:
        def __init__(self, enable_timing=True):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return next(ms)

    flush = torch.ones(4, dtype=torch.int32)
    zeroed = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "l2_flush_buffer", lambda: flush)
    monkeypatch.setattr(flush, "zero_", lambda: zeroed.append(1))
    monkeypatch.setattr(bench.triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: -1.0)
    calls = []
    ms = iter([10.0])  # 10 ms against rep 200: 20 samples in do_bench
    assert bench.bench(lambda: calls.append(1), 50, 200) == -1.0
    ms = iter([50.0, 61.0, 55.0, 70.0, 52.0, 58.0])  # 50 ms: 4 samples, too few
    assert bench.bench(lambda: calls.append(1), 50, 200) == 58.0  # (median of the last five)
    assert len(zeroed) == bench.SLOW_CALLS == 5 and bench.MIN_SAMPLES == 5


def test_source_digest_names_the_code(tmp_path):
    """Results record ``source_sha256`` of the package's .py files: the same for the same
    files in any walk order, different when a file's content or name changes; other files
    do not count."""
    bench = _bench_module()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "b.py").write_text("y = 2\n")
    d0 = bench.source_digest(str(tmp_path))
    (tmp_path / "notes.txt").write_text("not code")
    assert bench.source_digest(str(tmp_path)) == d0
    (tmp_path / "kernels" / "b.py").write_text("y = 3\n")
    d1 = bench.source_digest(str(tmp_path))
    (tmp_path / "kernels" / "b.py").rename(tmp_path / "kernels" / "c.py")
    assert len({d0, d1, bench.source_digest(str(tmp_path))}) == 3
    assert len(bench.source_digest()) == 64  # (the package itself)


def test_triton_cache_round_trip_names_the_new_folder(tmp_path):
    """triton_cache.py: a cache packed in one folder and unpacked in another lists each
    kernel's files under the new folder (Triton takes a listed path that does not exist
    for a miss, so a cache from another machine would otherwise never hit)."""
    import json

    old, new = tmp_path / "old", tmp_path / "new"
    entry = old / "KEY"
    entry.mkdir(parents=True)
    (entry / "k.cubin").write_bytes(b"\x7fELF")
    (entry / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.cubin": str(entry / "k.cubin")}}))
    tarball = tmp_path / "c.tar.xz"
    for args in (("pack", old, tarball), ("unpack", tarball, new)):
        r = run("triton_cache.py", *map(str, args))
        assert r.returncode == 0, r.stderr[-2000:]
    group = json.loads((new / "KEY" / "__grp__k.json").read_text())
    assert group == {"child_paths": {"k.cubin": str(new / "KEY" / "k.cubin")}}
    assert (new / "KEY" / "k.cubin").read_bytes() == b"\x7fELF"
