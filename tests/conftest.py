import os
import sys

# Test helpers (helpers.py, kernel_checks.py, sm90_compile.py) are imported by name.
sys.path.insert(0, os.path.dirname(__file__))

# tests/interpreter/ needs TRITON_INTERPRET=1 set before triton is imported, so it runs
# in its own process, started by test_triton_interpreter.py.
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore = ["interpreter"]
