"""Gluon kernels that print, when compiled, the linear layout of a [64, 64] fp32 wgmma
accumulator, and of a [64, 32] one (tests/sm90_compile.py, ``wgmma_register_bases``)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def print_wgmma_layout():
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64, 16])
    ll: gl.constexpr = gl.to_linear_layout(s_l, [64, 64])
    gl.static_print(ll)


@gluon.jit
def print_wgmma_row_layout():
    """The slots (rows) of that accumulator, as the backward's dKV rows index them
    (``backward_gluon._row_pair``)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 64, 16])
    ll: gl.constexpr = gl.to_linear_layout(gl.SliceLayout(1, s_l), [64])
    gl.static_print(ll)


@gluon.jit
def print_wgmma_layout_n32():
    """A [64, 32] accumulator (``backward_gluon``'s ``r_l``: the 576/512 layout's score-only
    columns, 32 a consumer)."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 32, 16])
    ll: gl.constexpr = gl.to_linear_layout(s_l, [64, 32])
    gl.static_print(ll)
