"""The D=512 kernel configurations compile for sm_90 (H100/H200) without a GPU.

Fails if a configuration needs more shared memory than a Hopper block may have, or if
its PTX lost the tensor-core wgmma path (fell back to mma.sync). Spills are reported;
for the Gluon kernels, Triton's bundled ptxas also checks registers.
"""
import pytest

from sm90_compile import (H200_SMEM_LIMIT, compile_backward, compile_backward_gluon, compile_forward,
                          compile_forward_gluon)

HEADS = [128, 64, 16]  # V4-Pro, V4-Flash, V4-Pro over 8-way tensor parallelism


@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("has_sink", [True, False])
def test_forward_d512_compiles_for_sm90(H, has_sink):
    r = compile_forward(512, H, has_sink=has_sink, run_ptxas=False)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    if H >= 64:  # wgmma needs 64-row head blocks
        assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    else:
        assert r["wgmma"] + r["mma_sync"] > 0, r


@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("atomic", [False, True])
def test_backward_d512_compiles_for_sm90(H, atomic):
    r = compile_backward(512, H, atomic=atomic, run_ptxas=False)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    if H >= 64:
        assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    else:
        assert r["wgmma"] + r["mma_sync"] > 0, r


@pytest.mark.parametrize("has_sink", [True, False])
def test_gluon_forward_d512_compiles_for_sm90(has_sink):
    """The Gluon kernel (the default forward for D=512, H>16 on Hopper)."""
    r = compile_forward_gluon(has_sink=has_sink)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    # No register spills (Triton's bundled ptxas, where present): hoisted wgmma
    # descriptors that spilled once cost this kernel 19% (benchmarks/NOTES.md).
    assert r["spill_bytes"] in (None, 0), r


@pytest.mark.parametrize("atomic", [False, True])
def test_gluon_backward_d512_compiles_for_sm90(atomic):
    """The Gluon main kernel of the backward (the default for D=512 on Hopper)."""
    r = compile_backward_gluon(atomic=atomic)
    assert r["shared"] <= H200_SMEM_LIMIT, r
    assert r["wgmma"] > 0 and r["mma_sync"] == 0, r
    # Short of registers, ptxas serialises every wgmma (info C7512): a loop-invariant
    # tensor of store offsets once did that to this kernel (benchmarks/NOTES.md).
    # A few hundred spill bytes, outside the tensor-core chain, are expected.
    assert r["wgmma_serialized"] in (None, False), r
    assert r["spill_bytes"] is None or r["spill_bytes"] <= 1024, r
    # ...but none reloaded in the consumers' block loops: a reload queues behind the warp
    # group's dKV stores, so the next block waits for them to drain (-8% backward time
    # once the P/dS descriptors stopped spilling; benchmarks/NOTES.md, seventh session).
    if r["mma_loops"] is not None:
        assert len(r["mma_loops"]) == 2, r["mma_loops"]  # one block loop per consumer
        assert all(lp["LDL"] == 0 for lp in r["mma_loops"]), r["mma_loops"]
