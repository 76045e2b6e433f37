"""The fast mode's dKV accumulator order, checked without a GPU.

The Gluon backward adds each [64 slots, 64 columns] piece of dKV with 16-byte reductions
(``hopper.red_f32x4_fake``) whose asm computes addresses from the lane id and the packed
registers. Here the asm's address arithmetic is replayed for every thread and register of
the wgmma accumulator layout (as this Triton states it) and must put every value at
``fake_col`` of its column, each 16-byte reduction on 16 contiguous, aligned bytes; the
conversion kernel must undo exactly that permutation (interpreter test).
"""
import torch

from dsv4_sparse_attn.kernels.hopper import fake_col
from sm90_compile import wgmma_register_bases

LANE_BASES = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]  # wgmma m64nNk16, [row, col]
WARP_BASES = [[16, 0], [32, 0]]


def _coord(bases, bits):
    r = c = 0
    for i, (br, bc) in enumerate(bases):
        if bits >> i & 1:
            r ^= br
            c ^= bc
    return r, c


def test_reductions_put_every_value_at_its_fake_column():
    reg_bases = wgmma_register_bases()
    seen = {}
    for warp in range(4):
        for lane in range(32):
            wr, wc = _coord(WARP_BASES, warp)
            lr, lc = _coord(LANE_BASES, lane)
            regs = [(wr ^ lr ^ rr, wc ^ lc ^ rc) for rr, rc in (_coord(reg_bases, i) for i in range(32))]
            for p0 in range(0, 32, 8):  # one asm instance: registers p0..p0+7
                e = regs[p0:p0 + 8]
                # the asm: group base of elements 0 (row r) and 2 (row r+8), plus 16 bytes x (lane % 4)
                for base_elem, vals in ((0, (0, 1, 4, 5)), (2, (2, 3, 6, 7))):
                    row, col = e[base_elem]
                    addr = (col // 16) * 16 + 4 * (lane % 4)  # in fp32 words within the row
                    assert addr % 4 == 0  # 16-byte aligned
                    for k, v in enumerate(vals):
                        vr, vc = e[v]
                        assert vr == row, (warp, lane, p0, e)
                        seen[(vr, vc)] = addr + k
    assert len(seen) == 64 * 64  # every value of the piece, once
    want = fake_col(torch.arange(64)).tolist()
    assert all(seen[(r, c)] == want[c] for (r, c) in seen)


def test_fake_col_is_a_permutation_within_16_column_groups():
    c = torch.arange(512)
    f = fake_col(c)
    assert torch.equal(torch.sort(f).values, c)
    assert torch.equal(f // 16, c // 16)
