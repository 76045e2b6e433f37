import os
import sys

# Test helpers (helpers.py, kernel_checks.py, sm90_compile.py) are imported by name.
sys.path.insert(0, os.path.dirname(__file__))

# tests/interpreter/ needs TRITON_INTERPRET=1 set before triton is imported: without it,
# tests/interpreter/conftest.py runs the selected tests there in a child process that has it.
