"""How fast the L2 adds what a deterministic dKV reduction would send: 64-row blocks of
random accumulator rows, 512 columns, every instruction form that an exact (integer)
accumulation could use, next to the fast mode's 16-byte fp32 reductions.

    PYTHONPATH=src python benchmarks/experiments/red_probe_bench.py

Question (docs/performance/backward.md#exact-integer-sums-measured): an order-independent
sum needs integer adds. 64-bit ones measured 4x slower than fp32 ones per value (the probe
of dkv_modes_bench.py, plain ``tl.atomic_add``); a fixed-point value split into two int32
words that each wrap (two's complement adds are exact in any order) sends the same 8 bytes
as one int64, as scalar ``red.add.s32`` (PTX has no vector form for integers). Prediction:
the L2 adds int32 at the fp32 scalar rate per value (about 900 values/ns L2-resident), so
two words add values at half that rate, 4x below the 16-byte fp32 reductions' rate per
instruction; the deterministic mode built on them would then take about twice the fast
mode's reduction time (0.65-0.75x cuDNN at H64 K640).
"""
import json

import torch
import triton
import triton.language as tl

dev = "cuda"

# one instruction each; $0 a dummy output (inline asm needs one)
_ASM = {
    "f32x4 red": ("red.relaxed.gpu.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.b32 $0, 0;", "=r,l,r,r,r,r"),
    "f32 red": ("red.relaxed.gpu.global.add.f32 [$1], $2; mov.b32 $0, 0;", "=r,l,r"),
    "s32 red": ("red.relaxed.gpu.global.add.s32 [$1], $2; mov.b32 $0, 0;", "=r,l,r"),
    "u64 red": ("red.relaxed.gpu.global.add.u64 [$1], $2; mov.b32 $0, 0;", "=r,l,l"),
    "f32x4 store": ("st.global.v4.f32 [$1], {$2, $3, $4, $5}; mov.b32 $0, 0;", "=r,l,r,r,r,r"),
}
# values a row's 512 columns send, bytes a value, instructions per 4 values
MODES = [("f32x4 red", 4, 1), ("f32 red", 4, 4), ("s32 red", 4, 4), ("s32 x2 red", 8, 8), ("u64 red", 8, 4),
         ("f32x4 store", 4, 1)]


@triton.jit
def _probe(ACC, ROWS, n_blocks, ASM: tl.constexpr, CONS: tl.constexpr, KIND: tl.constexpr):
    # KIND 0: one 16-byte instruction per 4 columns; 1: one 4-byte instruction per column;
    # 2: two 4-byte words per column (interleaved: the value's 8 bytes adjacent); 3: 8 bytes
    pid = tl.program_id(0)
    r = tl.arange(0, 64)
    g = tl.arange(0, 128)
    c = tl.arange(0, 512)
    for b in range(pid, n_blocks, tl.num_programs(0)):
        rows = tl.load(ROWS + b * 64 + r).to(tl.int64)
        if KIND == 0:
            base = (ACC + rows[:, None] * 512 + g[None, :] * 4).to(tl.int64, bitcast=True)
            v = (r[:, None] + g[None, :]).to(tl.float32) * 1e-3
            tl.inline_asm_elementwise(ASM, CONS, [base, v, v + 1.0, v + 2.0, v + 3.0], dtype=tl.int32,
                                      is_pure=False, pack=1)
        elif KIND == 1:
            ptr = (ACC + rows[:, None] * 512 + c[None, :]).to(tl.int64, bitcast=True)
            v = (r[:, None] + c[None, :]).to(tl.float32) * 1e-3
            tl.inline_asm_elementwise(ASM, CONS, [ptr, v], dtype=tl.int32, is_pure=False, pack=1)
        elif KIND == 2:
            ptr = (ACC + rows[:, None] * 1024 + c[None, :] * 2).to(tl.int64, bitcast=True)
            v = (r[:, None] * 7 + c[None, :]).to(tl.int32)
            tl.inline_asm_elementwise(ASM, CONS, [ptr, v], dtype=tl.int32, is_pure=False, pack=1)
            tl.inline_asm_elementwise(ASM, CONS, [ptr + 4, v + 3], dtype=tl.int32, is_pure=False, pack=1)
        else:
            ptr = (ACC + rows[:, None] * 1024 + c[None, :] * 2).to(tl.int64, bitcast=True)
            v = (r[:, None] * 7 + c[None, :]).to(tl.int64)
            tl.inline_asm_elementwise(ASM, CONS, [ptr, v], dtype=tl.int32, is_pure=False, pack=1)


def main():
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), "triton", triton.__version__, flush=True)
    n_blocks = 4096 * 10
    out = []
    for R in (5120, 163840):
        rows_t = torch.randint(0, R, (n_blocks * 64,), device=dev, dtype=torch.int32)
        for name, nbytes, _ in MODES:
            asm = _ASM["s32 red" if name == "s32 x2 red" else name]
            kind = {"f32x4 red": 0, "f32x4 store": 0, "f32 red": 1, "s32 red": 1, "s32 x2 red": 2,
                    "u64 red": 3}[name]
            acc = torch.zeros((R, 1024 if nbytes == 8 else 512), dtype=torch.float32, device=dev)
            for warps in (4, 8):
                def f(acc=acc, warps=warps):
                    _probe[(132 * 4,)](acc, rows_t, n_blocks, ASM=asm[0], CONS=asm[1], KIND=kind,
                                       num_warps=warps)

                f()
                ms = do_bench(f, warmup=5, rep=40)
                vals = n_blocks * 64 * 512
                out.append(dict(rows=R, mode=name, warps=warps, ms=round(ms, 4),
                                values_per_ns=round(vals / ms / 1e6, 1),
                                payload_TBps=round(vals * nbytes / ms / 1e9, 2)))
                print(json.dumps(out[-1]), flush=True)
            acc = None
    print("| accumulator rows | " + " | ".join(m[0] for m in MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for R in (5120, 163840):
        cells = []
        for name, _, _ in MODES:
            best = max((o for o in out if o["rows"] == R and o["mode"] == name),
                       key=lambda o: o["values_per_ns"])
            cells.append(f"{best['values_per_ns']:.0f} ({best['payload_TBps']:.1f} TB/s)")
        print(f"| {R} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
