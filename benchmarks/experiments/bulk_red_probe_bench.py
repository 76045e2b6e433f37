"""How fast the L2 adds dKV pieces sent by TMA bulk reductions from shared memory
(``cp.reduce.async.bulk.global.shared::cta.bulk_group.add``), next to the fast mode's
16-byte register reductions (``red.global.add.v4.f32``), on the same 64-row blocks of
random accumulator rows, 512 columns.

    PYTHONPATH=src python benchmarks/experiments/bulk_red_probe_bench.py

Question (docs/performance/backward.md#open-leads, the dKV reductions by TMA): the fast
mode is bound by its reductions, which run through the SM's load/store path; a bulk
reduction takes a whole 256-byte row piece (64 fp32 columns) from shared memory in one
instruction and leaves the L2 to add it. The main kernel has one 16 KB staging buffer to
spare (split 1: a [64, 64] fp32 piece), so a piece must be staged, sent, and read out
of shared memory before the next is staged. Prediction: if the L2 adds bulk pieces at the
16-byte reductions' rate (about 920 values/ns L2-resident) with 16-64 issuing threads and
a wait for the staging's reads between pieces, the main kernel can move its reductions
off the load/store path; if the per-piece read wait costs more than a piece's wgmma
(about 250 cycles), a single staging buffer cannot hide it.

Arms: ``f32x4 red`` (registers, the shipped form), then bulk ``add.f32`` / ``add.u64`` /
``add.s32`` with ISSUE threads each sending 64 / ISSUE rows a piece; ``wait``: every piece
restaged (16 KB of st.shared), fenced, sent, and its reads waited for before the next.
"""
import json

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from dsv4_sparse_attn.kernels.hopper import thread_barrier

dev = "cuda"

_BULK = ("{{\n .reg .pred p;\n .reg .u32 s;\n setp.ne.b32 p, $3, 0;\n mov.u32 s, global_smem;\n"
         " add.u32 s, s, $2;\n"
         " @p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.{ty} [$1], [s], 256;\n"
         " mov.b32 $0, 0;\n}}")
_PRED = "{\n .reg .pred p;\n setp.ne.b32 p, $1, 0;\n @p %s;\n mov.b32 $0, 0;\n}"
_COMMIT = gl.constexpr(_PRED % "cp.async.bulk.commit_group")
_WAIT_READ = gl.constexpr(_PRED % "cp.async.bulk.wait_group.read 0")
_WAIT_ALL = gl.constexpr(_PRED % "cp.async.bulk.wait_group 0")


@gluon.jit
def _bulk_probe(ACC, ROWS, n_blocks, row_elems, BULK: gl.constexpr, ISSUE: gl.constexpr,
                WAIT: gl.constexpr, KIND: gl.constexpr):
    # the only shared allocation: offset 0 of global_smem, rows of 256 bytes
    sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    L: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    T1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    RPI: gl.constexpr = 64 // ISSUE
    if KIND == 1:  # u64
        stage = gl.allocate_shared_memory(gl.int64, [64, 32], sl)
        vals = gl.full([64, 32], 1, gl.int64, L)
    elif KIND == 2:  # s32
        stage = gl.allocate_shared_memory(gl.int32, [64, 64], sl)
        vals = gl.full([64, 64], 1, gl.int32, L)
    else:
        stage = gl.allocate_shared_memory(gl.float32, [64, 64], sl)
        vals = gl.full([64, 64], 1.0, gl.float32, L)
    stage.store(vals)
    fence_async_shared()
    thread_barrier()
    t = gl.arange(0, 128, layout=T1)
    issuer = (t < ISSUE).to(gl.int32)
    for b in range(gl.program_id(0), n_blocks, gl.num_programs(0)):
        for p in gl.static_range(8):  # the 8 pieces of 64 columns of a 512-column row
            if WAIT:
                stage.store(vals)
                fence_async_shared()
                thread_barrier()
            for k in gl.static_range(RPI):
                r = gl.where(t < ISSUE, t * RPI + k, 0)
                row = gl.load(ROWS + b * 64 + r).to(gl.int64)
                dst = ACC + row * row_elems + p * 64  # (fp32 elements)
                gl.inline_asm_elementwise(BULK, "=r,l,r,r", [dst, r * 256, issuer], dtype=gl.int32,
                                          is_pure=False, pack=1)
            gl.inline_asm_elementwise(_COMMIT, "=r,r", [issuer], dtype=gl.int32, is_pure=False, pack=1)
            if WAIT:
                gl.inline_asm_elementwise(_WAIT_READ, "=r,r", [issuer], dtype=gl.int32, is_pure=False, pack=1)
                thread_barrier()
    gl.inline_asm_elementwise(_WAIT_ALL, "=r,r", [issuer], dtype=gl.int32, is_pure=False, pack=1)


@triton.jit
def _red_probe(ACC, ROWS, n_blocks):
    # the shipped form: 16-byte fp32 reductions from registers (red_probe_bench's f32x4 red)
    pid = tl.program_id(0)
    r = tl.arange(0, 64)
    g = tl.arange(0, 128)
    for b in range(pid, n_blocks, tl.num_programs(0)):
        rows = tl.load(ROWS + b * 64 + r).to(tl.int64)
        base = (ACC + rows[:, None] * 512 + g[None, :] * 4).to(tl.int64, bitcast=True)
        v = (r[:, None] * 0 + g[None, :] * 0).to(tl.float32) + 1.0
        tl.inline_asm_elementwise("red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.b32 $0, 0;",
                                  "=r,l,r,r,r,r", [base, v, v, v, v], dtype=tl.int32, is_pure=False, pack=1)


def main():
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    n_blocks = 4096 * 10
    vals = n_blocks * 64 * 512
    out = []
    for R in (5120, 163840):
        rows_t = torch.randint(0, R, (n_blocks * 64,), device=dev, dtype=torch.int32)
        counts = torch.bincount(rows_t.long(), minlength=R)
        arms = [("f32x4 red", None, 0, 0, 0)]
        for ty in ("f32", "u64", "s32"):
            for issue in (64, 16, 4):
                for wait in (0, 1):
                    if ty != "f32" and (issue != 64 or wait != 1):
                        continue
                    arms.append((f"bulk {ty}", ty, issue, wait, {"f32": 0, "u64": 1, "s32": 2}[ty]))
        for name, ty, issue, wait, kind in arms:
            acc = torch.zeros((R, 512), dtype=torch.float32, device=dev)
            for progs in (132, 264):
                if ty is None:
                    def f(acc=acc, progs=progs):
                        _red_probe[(progs,)](acc, rows_t, n_blocks, num_warps=4)
                else:
                    bulk = _BULK.format(ty=ty)

                    def f(acc=acc, progs=progs, bulk=bulk, issue=issue, wait=wait, kind=kind):
                        _bulk_probe[(progs,)](acc, rows_t, n_blocks, 512, BULK=bulk, ISSUE=issue, WAIT=wait,
                                              KIND=kind, num_warps=4)
                acc.zero_()
                f()
                torch.cuda.synchronize()
                # every row got its count of adds of ones in each of its 512 columns
                if ty == "u64":
                    got = acc.view(torch.int64).sum(1)
                    ok = bool(torch.equal(got, counts * 256))
                elif ty == "s32":
                    got = acc.view(torch.int32).sum(1).long()
                    ok = bool(torch.equal(got, counts * 512))
                else:
                    ok = bool(torch.equal(acc.sum(1).long(), counts * 512))
                ms = do_bench(f, warmup=5, rep=40)
                out.append(dict(rows=R, arm=name, issue=issue, wait=wait, programs=progs, ok=ok,
                                ms=round(ms, 4), values_per_ns=round(vals / ms / 1e6, 1),
                                TBps=round(vals * 4 / ms / 1e9, 2)))
                print(json.dumps(out[-1]), flush=True)
            acc = None
    print("| rows | arm | issuing threads | wait a piece | best values/ns (TB/s) | ok |")
    print("|---|---|---|---|---|---|")
    keys = []
    for o in out:
        k = (o["rows"], o["arm"], o["issue"], o["wait"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        best = max((o for o in out if (o["rows"], o["arm"], o["issue"], o["wait"]) == k),
                   key=lambda o: o["values_per_ns"])
        oks = all(o["ok"] for o in out if (o["rows"], o["arm"], o["issue"], o["wait"]) == k)
        print(f"| {k[0]} | {k[1]} | {k[2] or '-'} | {k[3]} | "
              f"{best['values_per_ns']:.0f} ({best['TBps']:.2f}) | {oks} |")


if __name__ == "__main__":
    main()
