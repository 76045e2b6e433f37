"""Runs tests/interpreter/ in a child process with TRITON_INTERPRET=1.

The variable must be set before triton is imported, which this process has already
done; the child's pytest output is shown when it fails.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_triton_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(HERE, "interpreter")],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter tests failed:\n{tail}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
