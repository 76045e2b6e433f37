"""The split schedule's barrier protocol (the Gluon backward's ``_consume_tile_split``) as a
model under random interleavings (benchmarks/experiments/split_schedule_model.py): no
deadlock and every read sees its block with one or two P/dS buffers, and the model catches
the broken variants. The GPU tests run the kernel; this checks the protocol as written
down, on the CPU, before a change to it costs a hung GPU run."""
from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "benchmarks", "experiments", "split_schedule_model.py")


@pytest.fixture(scope="module")
def model():
    spec = importlib.util.spec_from_file_location("split_schedule_model", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("early", [0, 2, 3], ids=["", "early2", "early3"])
@pytest.mark.parametrize("split", [1, 2])
def test_split_schedule_protocol_holds_under_random_interleavings(model, split, early):
    """``early``: q's and dO's first quarters released by the last block's owner
    (``backward_gluon.QD_EARLY``): none replaced while a consumer reads it."""
    assert model.failures(split, seeds=1000, early=early) == 0


@pytest.mark.parametrize("split", [1, 2])
def test_split_schedule_protocol_holds_with_dq_by_tma(model, split):
    """dQ staged in q's quarters for a TMA store at the tile's end (``backward_gluon.DQ_TMA``):
    no staged dQ read as q, none overwritten before the TMA has read it, no deadlock (tiles
    without blocks among them)."""
    assert model.failures(split, seeds=1000, dq=1) == 0


def test_split_schedule_model_catches_dq_staged_without_waiting(model):
    """Staging in q without waiting for the last block's owner to have read it."""
    assert model.failures(2, "dq no wait", seeds=500, dq=1) > 0


def test_split_schedule_model_catches_an_early_release_at_every_block(model):
    assert model.failures(2, "early every block", seeds=300, early=2) > 0


@pytest.mark.parametrize("bug", ["per-consumer flags", "no follower wait", "pacing too far"])
def test_split_schedule_model_catches_broken_protocols(model, bug):
    assert model.failures(1, bug, seeds=300) > 0
