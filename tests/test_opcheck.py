"""torch.library.opcheck over the CPU samples of opcheck/run_opcheck.py (so CI runs it)."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "opcheck" / "run_opcheck.py"
_spec = importlib.util.spec_from_file_location("run_opcheck", _PATH)
run_opcheck = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("run_opcheck", run_opcheck)
_spec.loader.exec_module(run_opcheck)

_NAMES = [s.name for s in run_opcheck.samples("cpu")]


@pytest.fixture(scope="module")
def cpu_samples():
    return {s.name: s for s in run_opcheck.samples("cpu")}


def test_matrix_covers_what_it_should():
    names = "\n".join(_NAMES)
    assert len(_NAMES) == len(set(_NAMES))
    for op in ("sparse_mla-", "sparse_mla_fwd-", "sparse_mla_bwd-"):
        assert op in names
    for part in ("float32", "bfloat16", "float16", "int32", "int64", "sink0", "sink1", "grad1", "grad0",
                 "dlse0", "dlse1", "scaleNone", "scale0.3", "kv3d", "K0", "T0", "emptyrow", "K7", "K3"):
        assert part in names, part
    assert set(run_opcheck.TEST_UTILS) == {
        "test_schema", "test_autograd_registration", "test_faketensor",
        "test_aot_dispatch_static", "test_aot_dispatch_dynamic",
    }
    # the backward op never gets inputs that require grad (it has no double backward)
    for s in run_opcheck.samples("cpu"):
        if s.op == "sparse_mla_bwd":
            assert not any(getattr(a, "requires_grad", False) for a in s.args), s.name


@pytest.mark.parametrize("name", _NAMES)
def test_opcheck(cpu_samples, name):
    result = run_opcheck.run_sample(cpu_samples[name])
    assert set(result) == set(run_opcheck.TEST_UTILS), result
    bad = run_opcheck.failures(result)
    assert not bad, "\n".join(f"{k}: {v}" for k, v in bad.items())


def test_script_entry_point():
    """``python opcheck/run_opcheck.py`` prints the summary line and exits 0 (a quick subset)."""
    proc = subprocess.run(
        [sys.executable, str(_PATH), "--device", "cpu", "-k", "sparse_mla_bwd-float32-sink1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.endswith(" passed, 0 failed") and not last.startswith("0 "), last
