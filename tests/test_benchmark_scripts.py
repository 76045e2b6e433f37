"""benchmarks/: the GPU scripts still import and parse their options on a CPU machine.

They only run on the GPU (one device session a day), so a renamed function or a broken
import would otherwise surface there, costing device time.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["bench.py", "heads_sweep.py", "profile_bwd.py", "fsdp_step_time.py", "ab_backward.py", "power_probe.py",
           "store_pattern.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_starts(script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--help"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("usage:"), r.stdout[:500]
