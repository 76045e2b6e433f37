"""tests/interpreter/: the Triton kernels under the Triton interpreter, in a child process.

TRITON_INTERPRET=1 must be set before triton is first imported, and a pytest run has
imported it long before it reaches these tests (the package imports it). So:

* Started with TRITON_INTERPRET=1 (``TRITON_INTERPRET=1 pytest tests/interpreter``), the
  tests run here, in this process, as usual.
* Otherwise (``pytest tests``, ``pytest tests/interpreter``, a file or a node id under
  it, any ``-k`` / ``-m``), they are collected as usual (their modules import fine
  without the interpreter), and once every other selection has been applied the
  selected ones are replaced by one item, ``InterpreterRun``, which runs exactly those
  node ids in a child pytest with TRITON_INTERPRET=1 and fails with the child's report
  if any of them fails. Each selected test runs once, in the child: ``pytest tests``
  does not run them a second time in this process.

The child's outcome is read from its JUnit XML report, not from its exit status alone:
it must have run as many tests as were handed to it (a node id it could not find, or a
collection error, fails the item). If the child skipped all of them, the item is skipped
with the child's reasons.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TIMEOUT_S = 1800  # the whole directory takes ~10 s on 2 CPU cores
TAIL_CHARS = 6000


class ChildFailed(Exception):
    """The child pytest failed; the message holds its report (shown without a traceback)."""


class InterpreterRun(pytest.Item):
    """Runs ``nodeids`` in a child ``python -m pytest`` with TRITON_INTERPRET=1."""

    def __init__(self, *, nodeids, **kwargs):
        super().__init__(**kwargs)
        self.nodeids = list(nodeids)

    def runtest(self):
        env = dict(os.environ, TRITON_INTERPRET="1")
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "junit.xml"
            cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
                   f"--junitxml={report}", *self.nodeids]
            try:
                proc = subprocess.run(cmd, cwd=self.config.rootpath, env=env, capture_output=True,
                                      text=True, timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
                raise ChildFailed(f"the interpreter tests did not finish within {TIMEOUT_S} s:\n"
                                  f"{out[-TAIL_CHARS:]}") from None
            out = (proc.stdout + proc.stderr)[-TAIL_CHARS:]
            counts, skips = _read_junit(report) if report.exists() else (None, [])
        lines = out.strip().splitlines()
        summary = f"{lines[-1] if lines else 'no output'} (child pytest, TRITON_INTERPRET=1)"
        if proc.returncode != 0 or counts is None:
            raise ChildFailed(f"{summary} (exit status {proc.returncode})\n{out}")
        tests, failures, errors, skipped = counts
        if tests != len(self.nodeids) or failures or errors:
            raise ChildFailed(f"{summary}: ran {tests} of the {len(self.nodeids)} tests handed to it\n{out}")
        print(out)  # captured: shown with -rP / -s
        if skipped == tests:
            reasons = "; ".join(sorted(set(skips)))
            pytest.skip(f"all {tests} interpreter tests skipped in the child: {reasons}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ChildFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, f"{len(self.nodeids)} tests in a child process with TRITON_INTERPRET=1"


def _read_junit(path: Path):
    """(tests, failures, errors, skipped) summed over the report's test suites, and the skip messages."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = [sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")]
    skips = [el.get("message", "") for el in root.iter("skipped")]
    return tuple(counts), skips


def _parent_dir_node(item: pytest.Item):
    """The collector of this directory in the item's chain (the launcher's parent)."""
    for node in item.listchain():
        if isinstance(node, pytest.Collector) and getattr(node, "path", None) == HERE:
            return node
    return item.parent


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only what is selected is handed on
def pytest_collection_modifyitems(session, config, items):
    if INTERPRETED:
        return
    mine = [i for i, item in enumerate(items) if Path(item.path).resolve().is_relative_to(HERE)]
    if not mine:
        return
    nodeids = [items[i].nodeid for i in mine]
    launcher = InterpreterRun.from_parent(_parent_dir_node(items[mine[0]]),
                                          name="TRITON_INTERPRET=1", nodeids=nodeids)
    chosen = set(mine)
    rest = [item for i, item in enumerate(items) if i not in chosen]
    rest.insert(mine[0], launcher)  # where the first of them was
    items[:] = rest
