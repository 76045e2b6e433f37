"""The README's performance tables and docs/performance/bench.png, from bench.py's JSON results.

    python benchmarks/report.py                  # the newest full results in benchmarks/results/
    python benchmarks/report.py RESULTS.json [SWEEP.json] [--readme README.md] [--png PATH]
    python benchmarks/report.py --print-only     # print the tables, write nothing

With no file named: the newest default-table file and, if there is one, the newest
backward-sweep file in benchmarks/results/ (quick smoke runs are left out). The tables
replace the README text between ``<!-- perf-table:start -->`` and ``<!-- perf-table:end -->``;
the figure (matplotlib, ``pip install dsv4_sparse_attn[plot]``) shows TFLOPS per shape of
each of our kernels, plain PyTorch and the anchors below.

Runs on any machine (the standard library; matplotlib for the figure). ``validate`` is the
results schema: bench.py checks what it writes with it.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
README = os.path.join(ROOT, "README.md")
PNG = os.path.join(ROOT, "docs", "performance", "bench.png")
START, END = "<!-- perf-table:start -->", "<!-- perf-table:end -->"

# Other implementations' figures, TFLOPS on one H200 at T=4096, D=512, bf16 (window 128 +
# distinct pool ids, do_bench median), keyed by (H, K). Provenance: measured side by side
# with this package on 2026-12-01 (DESIGN.md section 3; docs/performance/results.md, "Next to
# other implementations"); bench.py does not re-run them. They are drawn hatched and
# labelled ANCHOR_NOTE; a cuDNN backward measured in the results replaces its anchor.
ANCHOR_NOTE = "anchor, measured 2026-12-01, not re-run"
ANCHORS = {
    "forward": {
        "FlashMLA sm90 sparse prefill forward": {
            (64, 640): 516, (128, 512): 494, (128, 1152): 557, (64, 160): 252},
    },
    "backward": {
        "cuDNN-frontend 1.32 DSA backward sm90": {(64, 640): 416, (128, 1152): 407},
    },
}
CUDNN = "cuDNN-frontend 1.32 DSA backward sm90"

MODES = ("fast", "deterministic")
FORWARD_KERNELS = ("gluon_sm90", "triton")


# --------------------------------------------------------------------------- schema
ENVELOPE = {"schema": int, "kind": str, "quick": bool, "complete": bool, "date": str, "timestamp": str,
            "commit": str, "gpu": dict, "versions": dict, "command": str, "settings": dict, "rows": list}
FIGURE = ("ms", "tflops")  # a measured figure; or {"error": ...}


def _check(cond, where, what):
    if not cond:
        raise ValueError(f"results schema: {where}: {what}")


def _figure(d, where, extra=()):
    _check(isinstance(d, dict), where, "not an object")
    if "error" in d:
        return
    for k in FIGURE + tuple(extra):
        _check(isinstance(d.get(k), (int, float)), where, f"no number {k!r} (has {sorted(d)})")


def validate(doc: dict) -> dict:
    """Check ``doc`` against the results schema (raises ValueError naming what is wrong).

    Envelope: schema (1), kind ("table" or "backward_sweep"), quick, complete, date,
    timestamp, commit, gpu {name, sm_count, ...}, versions {torch, triton, python, ...},
    command, settings, rows.
    Table row: label, T, H, K, D, optional d_v; fwd {kernel, ms, tflops, extra_gib}; fwd_kernels {name:
    {ms, tflops} or {rejected} or {error}}; bwd {fast, deterministic: {kernel, ms, tflops,
    extra_gib}}; bwd_triton {mode: {ms, tflops}} (empty where Triton is not run); step {ms,
    mode}; optional torch {fwd_ms, fwd_tflops, fwd_extra_gib, step_ms} and step_speedup.
    Sweep row: T, H, K, D, N, ids, valid_slots; fast, deterministic {kernel, ms, tflops,
    extra_gib}; torch {ms, tflops} or {skipped} or {error}; optional cudnn {ms, tflops,
    cos_dkv {mode: cosine}}; speedups {name: other's ms / ours}.
    """
    _check(isinstance(doc, dict), "envelope", f"not an object but a {type(doc).__name__} (a list of rows "
           "belongs in a .jsonl file)")
    for k, t in ENVELOPE.items():
        _check(isinstance(doc.get(k), t), "envelope", f"{k!r} should be a {t.__name__}, got {doc.get(k)!r}")
    _check(doc["schema"] == 1, "envelope", f"schema {doc['schema']} (this report reads 1)")
    _check(doc["kind"] in ("table", "backward_sweep"), "envelope", f"kind {doc['kind']!r}")
    for k in ("name", "sm_count"):
        _check(k in doc["gpu"], "gpu", f"no {k!r}")
    for k in ("torch", "triton", "python"):
        _check(k in doc["versions"], "versions", f"no {k!r}")
    for i, r in enumerate(doc["rows"]):
        where = f"rows[{i}]"
        for k in ("T", "H", "K", "D"):
            _check(isinstance(r.get(k), int), where, f"no integer {k!r}")
        _check(r.get("d_v") is None or isinstance(r["d_v"], int), where, "d_v is not an integer")
        if doc["kind"] == "table":
            _check(isinstance(r.get("label"), str), where, "no label")
            _figure(r.get("fwd"), where + ".fwd", ("extra_gib",))
            for name, f in r.get("fwd_kernels", {}).items():
                if "rejected" not in f:
                    _figure(f, f"{where}.fwd_kernels.{name}")
            for m in MODES:
                _figure(r.get("bwd", {}).get(m), f"{where}.bwd.{m}", ("extra_gib",))
            for m, f in r.get("bwd_triton", {}).items():
                _figure(f, f"{where}.bwd_triton.{m}")
            _check(isinstance(r.get("step", {}).get("ms"), (int, float)), where, "no step.ms")
        else:
            _check(isinstance(r.get("ids"), str), where, "no ids")
            for m in MODES:
                _figure(r.get(m), f"{where}.{m}", ("extra_gib",))
            t = r.get("torch", {})
            if "skipped" not in t:
                _figure(t, where + ".torch")
            if "cudnn" in r:
                _figure(r["cudnn"], where + ".cudnn")
    return doc


# --------------------------------------------------------------------------- loading
def load(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    validate(doc)
    doc["_path"] = path
    return doc


def newest(results_dir: str = RESULTS_DIR, triton_version: str | None = None,
           gpu: str | None = None) -> list:
    """The newest default-table and backward-sweep results in ``results_dir`` (given ``gpu``,
    the runs on a GPU whose name holds it first: the README's section is about one GPU, and
    a run on another does not replace its tables; then complete runs before partial ones,
    then the runs with the most rows: a run of a few shapes, such as one made next to
    another Triton, does not replace a whole table; then, given
    ``triton_version``, the runs under that Triton (a whole table under a carried Triton
    does not replace the one under the GPU machine's own); then by timestamp; quick runs
    left out): a list of 0 to 2 documents."""
    best = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            doc = load(path)
        except (OSError, ValueError) as e:
            print(f"report.py: skipping {path}: {e}", file=sys.stderr)
            continue
        if doc["quick"]:
            continue
        same_triton = triton_version is None or doc["versions"]["triton"] == triton_version
        same_gpu = not gpu or gpu.lower() in doc["gpu"]["name"].lower()
        key = (same_gpu, doc["complete"], len(doc["rows"]), same_triton, doc["timestamp"],
               os.path.basename(path))
        if doc["kind"] not in best or key > best[doc["kind"]][0]:
            best[doc["kind"]] = (key, doc)
    return [best[k][1] for k in ("table", "backward_sweep") if k in best]


def pick(docs: list) -> tuple:
    """(table document or None, backward-sweep document or None): the newest of each kind."""
    out = {}
    for d in docs:
        if d["kind"] not in out or d["timestamp"] > out[d["kind"]]["timestamp"]:
            out[d["kind"]] = d
    return out.get("table"), out.get("backward_sweep")


# --------------------------------------------------------------------------- tables
def _num(x, digits=0):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _rel(path: str) -> str:
    p = os.path.abspath(path)
    return os.path.relpath(p, ROOT) if p.startswith(ROOT + os.sep) else path


def caption(doc: dict) -> str:
    g, v = doc["gpu"], doc["versions"]
    dirty = " (with uncommitted changes)" if doc.get("commit_dirty") else ""
    s = (f"{g['name']} ({g['sm_count']} SMs), {doc['date']}, commit {doc['commit']}{dirty}, "
         f"torch {v['torch']}, triton {v['triton']}, Python {v['python']}")
    if doc["quick"]:
        s += "; quick smoke run (short timings)"
    if not doc["complete"]:
        s += "; incomplete run"
    if "_path" in doc:
        s += f"; `{_rel(doc['_path'])}`"
    if doc.get("note"):  # what the file says of its own run (e.g. a kernel changed after it)
        s += f" (note: {doc['note']})"
    return s


def table_markdown(doc: dict) -> str:
    rows = doc["rows"]
    Ts = sorted({r["T"] for r in rows})
    Ds = sorted({r["D"] for r in rows})
    bwd_kernels = sorted({_get(r, "bwd", m, "kernel") for r in rows for m in MODES} - {None})
    one_kernel = len(bwd_kernels) == 1
    head = (f"**Default table**: {caption(doc)}. "
            + (f"T={Ts[0]}, " if len(Ts) == 1 else "")
            + f"D={'/'.join(map(str, Ds))}, bf16, sink, "
            "DeepSeek ids (window 128 + uniform pool ids, seed 0). "
            "TFLOPS: forward 4·T·H·K·D, backward 10·T·H·K·D over the median call (rows with values "
            "narrower than keys: 2·T·H·K·(D+d_v) and 2·T·H·K·(3D+2d_v)); **bold**: the forward "
            "kernel the dispatcher picks"
            + (f"; backward main kernel {bwd_kernels[0]}" if one_kernel else "")
            + ". Step: forward + backward through `torch.ops.dsv4.sparse_mla` (default backward mode) "
            "against plain PyTorch autograd. Extra: peak GiB allocated beyond inputs and outputs.")
    cols = (["shape"] + (["T"] if len(Ts) > 1 else [])
            + ["H", "K", "fwd Gluon", "fwd Triton", "bwd fast / det", "bwd Triton-main fast / det",
               "step ms ours / PyTorch", "step speedup", "PyTorch fwd",
               "extra GiB fwd / bwd fast / bwd det / PyTorch fwd"])
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        fwd = []
        for name in FORWARD_KERNELS:
            f = _get(r, "fwd_kernels", name) or {}
            cell = "err" if "error" in f else _num(f.get("tflops"))
            if cell not in ("-", "err") and _get(r, "fwd", "kernel") == name:
                cell = f"**{cell}**"
            fwd.append(cell)
        bwd = " / ".join(_num(_get(r, "bwd", m, "tflops")) for m in MODES)
        if not one_kernel:
            bwd += " (" + " / ".join(str(_get(r, "bwd", m, "kernel")) for m in MODES) + ")"
        tri = " / ".join(_num(_get(r, "bwd_triton", m, "tflops")) for m in MODES)
        tri = "-" if tri == "- / -" else tri
        step = f"{_num(_get(r, 'step', 'ms'), 2)} / {_num(_get(r, 'torch', 'step_ms'), 2)}"
        speed = f"{r['step_speedup']:.1f}x" if "step_speedup" in r else "-"
        extra = " / ".join(_num(x, 2) for x in (
            _get(r, "fwd", "extra_gib"), _get(r, "bwd", "fast", "extra_gib"),
            _get(r, "bwd", "deterministic", "extra_gib"), _get(r, "torch", "fwd_extra_gib")))
        shape = r["label"] + (f" (D={r['D']}, d_v={r['d_v']})" if r.get("d_v") else "")
        cells = ([shape] + ([str(r["T"])] if len(Ts) > 1 else []) + [str(r["H"]), str(r["K"])] + fwd
                 + [bwd, tri, step, speed, _num(_get(r, "torch", "fwd_tflops")), extra])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms_tf(f):
    if not isinstance(f, dict) or "ms" not in f:
        return "err" if isinstance(f, dict) and "error" in f else "-"
    return f"{f['ms']:.2f} ({f['tflops']:.0f})"


def sweep_markdown(doc: dict) -> str:
    rows = doc["rows"]
    has_cudnn = any("cudnn" in r for r in rows)
    head = (f"**Backward side by side**: {caption(doc)}. D={rows[0]['D'] if rows else 512}, bf16, sink, "
            "no grad_lse; ids: window 128 + distinct pool ids (N = T + max(T/4, K)) or causal pool ids "
            "(token t picks pool rows below t/4, -1 where there are too few: \"valid\" is the share of "
            "slots that are not masked). ms (TFLOPS, 10·T·H·K·D counted over every slot); extra: peak GiB "
            "beyond inputs and outputs; plain PyTorch only where its gathered rows (T·K·D·2 bytes) are "
            "under 8 GiB.")
    if has_cudnn:
        head += (" cuDNN: cuDNN-frontend 1.32's sm90 DSA backward on the same tensors; "
                 "\"vs cuDNN\": its time over ours (> 1: ours faster); "
                 "cos: cosine of its grad_kv with our deterministic one.")
    if doc["settings"].get("cudnn_error"):
        head += f" cuDNN not run: {doc['settings']['cudnn_error']}."
    cols = ["T", "H", "K", "ids (valid)", "ours fast", "ours deterministic", "plain PyTorch"]
    cols += ["cuDNN", "vs cuDNN fast / det", "cos dKV"] if has_cudnn else []
    cols += ["extra GiB fast / det"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r["T"]), str(r["H"]), str(r["K"]), f"{r['ids']} ({100 * r.get('valid_slots', 1):.0f}%)",
                 _ms_tf(r.get("fast")), _ms_tf(r.get("deterministic")), _ms_tf(r.get("torch"))]
        if has_cudnn:
            sp = r.get("speedups", {})
            cos = _get(r, "cudnn", "cos_dkv", "deterministic")
            vs = " / ".join(f"{sp[f'{m}_vs_cudnn']:.2f}x" if f"{m}_vs_cudnn" in sp else "-" for m in MODES)
            cells += [_ms_tf(r.get("cudnn")), vs, "-" if cos is None else f"{cos:.6f}"]
        cells.append(" / ".join(_num(_get(r, m, "extra_gib"), 2) for m in MODES))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(*docs) -> str:
    """Markdown: each document's table with its caption."""
    return "\n\n".join(table_markdown(d) if d["kind"] == "table" else sweep_markdown(d) for d in docs if d)


def perf_section(table=None, sweep=None, png=None, readme=README) -> str:
    """What goes between the README's markers."""
    srcs = ", ".join(f"`{_rel(d['_path'])}`" for d in (table, sweep) if d and "_path" in d)
    parts = [f"<!-- Generated by `python benchmarks/report.py`{' from ' + srcs if srcs else ''}; "
             "rerun it rather than editing this. -->", tables(table, sweep)]
    if png:
        rel = os.path.relpath(os.path.abspath(png), os.path.dirname(os.path.abspath(readme)))
        rel = rel.replace(os.sep, "/")
        parts.append(f"![TFLOPS per shape: our kernels, plain PyTorch and anchors]({rel})")
    return "\n\n".join(parts)


def update_readme(path: str, section: str) -> None:
    """Replace the text between START and END in ``path`` by ``section``."""
    with open(path) as f:
        text = f.read()
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{path}: needs exactly one {START} followed by one {END}")
    a, rest = text.split(START)
    _, b = rest.split(END)
    with open(path, "w") as f:
        f.write(f"{a}{START}\n{section}\n{END}{b}")


# --------------------------------------------------------------------------- figure
def plot(png: str, table=None, sweep=None) -> str:
    """Grouped bars of TFLOPS per shape (forward and backward panels) into ``png``: our
    kernels, plain PyTorch, and the anchors (hatched) or a measured cuDNN backward."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    if table is None and sweep is None:
        raise ValueError("plot: no results")
    meta = table or sweep
    if table is not None:
        T0 = 4096 if any(r["T"] == 4096 for r in table["rows"]) else table["rows"][0]["T"]
        # (the D = 512 rows: the 576/512 ones count other FLOPs and share their (H, K))
        rows0 = [r for r in table["rows"] if r["T"] == T0 and not r.get("d_v")]
        shapes = [(r["H"], r["K"], r["label"]) for r in rows0]
        by_hk = {(r["H"], r["K"]): r for r in rows0}
    else:
        T0 = 4096
        shapes = [(r["H"], r["K"], "") for r in sweep["rows"]
                  if r["T"] == T0 and r["ids"] == "distinct"]
        by_hk = {}
    sweep_hk = {(r["H"], r["K"]): r for r in (sweep or {}).get("rows", [])
                if r["T"] == T0 and r["ids"] == "distinct"}
    hks = [(H, K) for H, K, _ in shapes]

    def series(fn):
        out = []
        for hk in hks:
            try:
                v = fn(hk)
            except (KeyError, TypeError):
                v = None
            out.append(float(v) if isinstance(v, (int, float)) else math.nan)
        return out

    def anchor(kind, name):
        return series(lambda hk: ANCHORS[kind][name].get(hk))

    # (label, values, colour, anchor?)
    panels = []
    if table is not None:
        panels.append(("Forward", [
            ("ours, Gluon (gluon_sm90)", series(lambda hk: by_hk[hk]["fwd_kernels"]["gluon_sm90"]["tflops"]),
             "#1f5fa8", False),
            ("ours, Triton", series(lambda hk: by_hk[hk]["fwd_kernels"]["triton"]["tflops"]),
             "#6fa8dc", False),
            ("plain PyTorch", series(lambda hk: by_hk[hk]["torch"]["fwd_tflops"]), "#999999", False),
        ] + [(f"{n} ({ANCHOR_NOTE})", anchor("forward", n), "#c0392b", True) for n in ANCHORS["forward"]]))
    src = by_hk if table is not None else sweep_hk
    get_bwd = (lambda hk, m: src[hk]["bwd"][m]["tflops"]) if table is not None else (
        lambda hk, m: src[hk][m]["tflops"])
    bwd = [("ours, fast", series(lambda hk: get_bwd(hk, "fast")), "#2e7d32", False),
           ("ours, deterministic", series(lambda hk: get_bwd(hk, "deterministic")), "#81c784", False)]
    torch_bwd = series(lambda hk: sweep_hk[hk]["torch"]["tflops"])
    if any(math.isfinite(v) for v in torch_bwd):
        bwd.append(("plain PyTorch (backward sweep)", torch_bwd, "#999999", False))
    measured = series(lambda hk: sweep_hk[hk]["cudnn"]["tflops"])
    if any(math.isfinite(v) for v in measured):
        # (cuDNN's bars next to ours from the same run: the sweep's ids and inputs differ
        # from the table's, and tables from different runs are not compared)
        if table is not None:
            bwd = [(f"{name} (table)", v, c, h) for name, v, c, h in bwd[:2]] + bwd[2:]
            bwd.append(("ours, fast (backward sweep)", series(lambda hk: sweep_hk[hk]["fast"]["tflops"]),
                        "#1b5e20", False))
        bwd.append((f"{CUDNN} (measured {sweep['date']})", measured, "#e67e22", False))
    for n in ANCHORS["backward"]:
        vals = anchor("backward", n)
        if n == CUDNN:  # a measured figure replaces the anchor
            vals = [a if not math.isfinite(m) else math.nan for a, m in zip(vals, measured)]
        if any(math.isfinite(v) for v in vals):
            bwd.append((f"{n} ({ANCHOR_NOTE})", vals, "#e67e22", True))
    panels.append(("Backward", bwd))

    fig = Figure(figsize=(15, 4.2 * len(panels) + 0.8), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    x = list(range(len(shapes)))
    for ax, (title, ser) in zip(axes, panels):
        width = 0.8 / len(ser)
        top = max([v for _, vals, _, _ in ser for v in vals if math.isfinite(v)] + [1.0])
        for i, (label, vals, colour, is_anchor) in enumerate(ser):
            pts = [(xi - 0.4 + width * (i + 0.5), v) for xi, v in zip(x, vals) if math.isfinite(v)]
            style = (dict(facecolor="white", edgecolor=colour, hatch="///", linewidth=1.2) if is_anchor
                     else dict(color=colour))
            bars = ax.bar([p[0] for p in pts], [p[1] for p in pts], width * 0.92, label=label, **style)
            ax.bar_label(bars, labels=[f"{p[1]:.0f}" for p in pts], fontsize=8, rotation=90, padding=2)
        D = meta["rows"][0]["D"] if meta["rows"] else 512
        ax.set_title(f"{title} (T={T0}, D={D}, bf16)", fontsize=11)
        ax.set_ylabel("TFLOPS", fontsize=10)
        ax.set_ylim(0, top * 1.2)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{lab}\nH{H} K{K}".strip() for H, K, lab in shapes], fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    g, v = meta["gpu"], meta["versions"]
    fig.suptitle(f"dsv4_sparse_attn on {g['name']}: {meta['date']}, commit {meta['commit']}, "
                 f"torch {v['torch']}, triton {v['triton']}", fontsize=12)
    notes = []
    if table is not None:
        notes.append(f"forward, and backward 'ours': {os.path.basename(table.get('_path', 'table'))} "
                     "(uniform pool ids)")
    if sweep is not None:
        notes.append(f"backward sweep (plain PyTorch, cuDNN, ours beside it): "
                     f"{os.path.basename(sweep.get('_path', 'sweep'))} (distinct pool ids)")
    notes.append(f"hatched: {ANCHOR_NOTE} (H200, distinct pool ids)")
    # (one note a line: on one line they ran past the figure's width and were cut off)
    fig.supxlabel("\n".join(notes), fontsize=8, color="#444444")
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    return png


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="README performance tables and docs/performance/bench.png from "
                                             "benchmarks/bench.py's JSON results.")
    ap.add_argument("json", nargs="*", help="results files (default: the newest table and "
                                            "backward-sweep files in benchmarks/results/)")
    ap.add_argument("--results-dir", default=RESULTS_DIR, help="where to look for the newest results")
    ap.add_argument("--readme", default=README, help="the README whose marked section is rewritten")
    ap.add_argument("--png", default=PNG, help="the figure to write")
    ap.add_argument("--triton", default=None,
                    help="prefer the runs under this Triton version (default: the installed one, on the GPU "
                         "machine its own, not one carried there)")
    ap.add_argument("--gpu", default="H200",
                    help="prefer the runs on a GPU whose name holds this (default H200, the GPU the README's "
                         "section names and the issues' targets are set on; '' for any)")
    ap.add_argument("--no-plot", action="store_true", help="tables only")
    ap.add_argument("--print-only", action="store_true", help="print the tables; write nothing")
    a = ap.parse_args(argv)

    if a.triton is None:
        try:
            import triton
            a.triton = triton.__version__
        except ImportError:
            pass
    docs = [load(p) for p in a.json] if a.json else newest(a.results_dir, a.triton, a.gpu)
    if not docs:
        sys.exit(f"report.py: no results in {a.results_dir} "
                 "(run benchmarks/bench.py on a GPU, or name the files)")
    table, sweep = pick(docs)
    for d in docs:
        if d is not table and d is not sweep:
            print(f"report.py: leaving out {d['_path']} (a newer {d['kind']} file is given)", file=sys.stderr)
    if a.print_only:
        print(tables(table, sweep))
        return 0
    png = None
    if not a.no_plot:
        try:
            import matplotlib  # noqa: F401
            png = plot(a.png, table, sweep)
        except ImportError:
            print("report.py: no matplotlib, so no figure: pip install dsv4_sparse_attn[plot]",
                  file=sys.stderr)
    section = perf_section(table, sweep, png, a.readme)
    update_readme(a.readme, section)
    print(section)
    print(f"\nupdated {a.readme}" + (f", wrote {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
