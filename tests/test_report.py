"""benchmarks/report.py: the README's performance section and the figure, from results JSON.

The example files in tests/data/ have the schema benchmarks/bench.py writes (checked by
``report.validate``, which bench.py also runs on its own output) with made-up figures.
"""
from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
TABLE = os.path.join(DATA, "bench_table_example.json")
SWEEP = os.path.join(DATA, "bench_sweep_example.json")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import report  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def readme(tmp_path):
    path = tmp_path / "README.md"
    shutil.copy(os.path.join(ROOT, "README.md"), path)
    return path


def test_readme_has_the_markers():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert text.count(report.START) == 1 and text.count(report.END) == 1
    assert text.index(report.START) < text.index(report.END)
    section = text[text.index("## Kernels and performance"):]
    assert report.START in section.split("\n## ")[0], "the markers belong in the performance section"


def test_example_files_follow_the_schema():
    for path in (TABLE, SWEEP):
        report.validate(json.load(open(path)))
    bad = json.load(open(TABLE))
    del bad["rows"][0]["bwd"]["fast"]["tflops"]
    with pytest.raises(ValueError, match=r"rows\[0\]\.bwd\.fast"):
        report.validate(bad)
    bad = json.load(open(SWEEP))
    bad["kind"] = "other"
    with pytest.raises(ValueError, match="kind"):
        report.validate(bad)


def test_committed_results_follow_the_schema():
    # report.py reads every benchmarks/results/*.json and takes the table and sweep
    # documents (features_bench.py's have a kind of their own); experiments' rows go in
    # .jsonl files
    docs = [json.load(open(p)) for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json"))]
    assert all(isinstance(d, dict) and isinstance(d.get("kind"), str) for d in docs)
    read = [d for d in docs if d["kind"] in ("table", "backward_sweep")]
    assert read
    for d in read:
        report.validate(d)
    with pytest.raises(ValueError, match="not an object but a list"):
        report.validate([{"T": 4096}])


def test_readme_section_and_figure(readme, tmp_path):
    before = readme.read_text()
    png = tmp_path / "perf" / "bench.png"
    table, sweep = report.load(TABLE), report.load(SWEEP)
    report.plot(str(png), table, sweep)
    section = report.perf_section(table, sweep, str(png), str(readme))
    report.update_readme(str(readme), section)
    after = readme.read_text()

    head, rest = before.split(report.START)
    _, tail = rest.split(report.END)
    assert after == f"{head}{report.START}\n{section}\n{report.END}{tail}"  # the rest is unchanged
    assert ("| V4-Pro CSA | 128 | 1152 | **526** | 252 | 298 / 219 | 216 / 143 | 16.48 / 73.20 | 4.4x | 54 |"
            in section)
    assert "| V4-Pro TP8 | 16 | 1152 | - | **152** | 77 / 51 |" in section  # the Gluon forward rejects H=16
    assert ("NVIDIA H200 (132 SMs), 2026-12-02, commit 0000000, torch 2.13.0, triton 3.6.0, Python 3.12.3"
            in section)
    assert "`tests/data/bench_table_example.json`" in section
    assert "**Backward side by side**" in section
    assert ("| 4096 | 64 | 640 | distinct (100%) | 3.19 (269) | 4.64 (185) | 71.58 (12) | 2.06 (416) "
            "| 0.65x / 0.44x | 0.999999 | 0.01 / 0.88 |" in section)
    assert "| 131072 | 128 | 1152 | causal (97%) |" in section and "| - | 250.52 (395) |" in section
    assert "](perf/bench.png)" in section

    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000

    # Again with the new section in place: the same text (the markers stay, nothing piles up).
    report.update_readme(str(readme), report.perf_section(table, sweep, str(png), str(readme)))
    assert readme.read_text() == after


def test_table_only_and_sweep_only(tmp_path):
    table, sweep = report.load(TABLE), report.load(SWEEP)
    text = report.tables(table)
    assert "Default table" in text and "side by side" not in text
    nocudnn = copy.deepcopy(sweep)
    for r in nocudnn["rows"]:
        r.pop("cudnn")
    text = report.tables(nocudnn)
    assert "cuDNN" not in text.split("\n\n", 1)[1]  # no cuDNN columns without cuDNN figures
    for args in ((table, None), (None, sweep), (table, nocudnn)):
        png = tmp_path / "f.png"
        report.plot(str(png), *args)
        assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_sweep_row_that_did_not_fit(tmp_path):
    """bench.py's sweep records a shape the GPU's memory cannot hold (its modes an error, no
    PyTorch figure) and goes on: the document stays valid and the row reads "err"."""
    sweep = copy.deepcopy(report.load(SWEEP))
    why = "out of memory on this 79 GiB GPU: CUDA out of memory. Tried to allocate 16.00 GiB."
    sweep["rows"].append(dict(T=131072, H=128, K=1152, D=512, ids="causal", fast={"error": why},
                              deterministic={"error": why}, torch={"skipped": why}))
    report.validate(sweep)
    last = report.tables(sweep).splitlines()[-1]
    assert last.startswith("| 131072 | 128 | 1152 | causal") and "| err | err | - |" in last, last
    png = tmp_path / "f.png"
    report.plot(str(png), None, sweep)
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_newest_files_are_picked(tmp_path):
    def put(name, src, **changes):
        doc = json.load(open(src))
        doc.update(changes)
        (tmp_path / name).write_text(json.dumps(doc))

    put("a.json", TABLE, timestamp="2026-12-01T00:00:00+00:00")
    put("b.json", TABLE, timestamp="2026-12-03T00:00:00+00:00")
    put("c.json", TABLE, timestamp="2026-12-04T00:00:00+00:00", quick=True)  # smoke runs are left out
    put("d.json", TABLE, timestamp="2026-12-05T00:00:00+00:00", complete=False)  # partial: after complete
    put("e.json", SWEEP)
    rows = json.load(open(TABLE))["rows"]
    put("f.json", TABLE, timestamp="2026-12-06T00:00:00+00:00", rows=rows[:1])  # a few shapes: not the table
    (tmp_path / "broken.json").write_text("{")
    docs = report.newest(str(tmp_path))
    assert [os.path.basename(d["_path"]) for d in docs] == ["b.json", "e.json"]
    # a whole table under another (carried) Triton, newer: picked only without a version
    versions = dict(json.load(open(TABLE))["versions"], triton="9.9.9")
    put("g.json", TABLE, timestamp="2026-12-07T00:00:00+00:00", versions=versions)
    mine = json.load(open(TABLE))["versions"]["triton"]
    assert os.path.basename(report.newest(str(tmp_path))[0]["_path"]) == "g.json"
    assert os.path.basename(report.newest(str(tmp_path), mine)[0]["_path"]) == "b.json"
    # a newer whole table on another GPU: picked only without a GPU preference
    gpu = dict(json.load(open(TABLE))["gpu"], name="NVIDIA H100 80GB HBM3")
    put("h.json", TABLE, timestamp="2026-12-08T00:00:00+00:00", gpu=gpu)
    assert os.path.basename(report.newest(str(tmp_path), mine)[0]["_path"]) == "h.json"
    assert os.path.basename(report.newest(str(tmp_path), mine, "H200")[0]["_path"]) == "b.json"
    assert os.path.basename(report.newest(str(tmp_path), mine, "H100")[0]["_path"]) == "h.json"


def test_command_line(readme, tmp_path):
    png = tmp_path / "out.png"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), TABLE, SWEEP,
                        "--readme", str(readme), "--png", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"updated {readme}" in r.stdout and png.read_bytes().startswith(PNG_SIGNATURE)
    assert "**526**" in readme.read_text()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), "--results-dir",
                        str(tmp_path / "none")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "no results" in r.stderr and "Traceback" not in r.stderr


def test_rows_of_the_v32_layout(tmp_path):
    """A table with 576/512 rows (bench.py's last three): valid, named with D and d_v in the
    table, and left out of the figure, whose bars are the D = 512 shapes."""
    doc = json.load(open(TABLE))
    v32 = copy.deepcopy(doc["rows"][0])
    v32.update(label="V3.2 layout", D=576, d_v=512)
    doc["rows"].append(v32)
    report.validate(doc)
    text = report.table_markdown(doc)
    assert "V3.2 layout (D=576, d_v=512)" in text
    assert text.count("\n| ") == len(doc["rows"]) + 1  # the header and one line per row
    png = tmp_path / "bench.png"
    report.plot(str(png), doc)
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    bad = copy.deepcopy(doc)
    bad["rows"][-1]["d_v"] = "512"
    with pytest.raises(ValueError, match="d_v"):
        report.validate(bad)
