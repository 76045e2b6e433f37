"""``kernels.l2_policy``: the access-policy window the fast backward's main kernel runs
under at long contexts, against a fake CUDA driver (CPU): what it sets, that it restores the
stream's window, reserves the set-aside once, and sets nothing where the driver refuses or
the tensor is not on a GPU."""
from __future__ import annotations

import contextlib
import ctypes
from types import SimpleNamespace

import pytest
import torch

from dsv4_sparse_attn.kernels import l2_policy


class FakeDriver:
    """The five driver calls ``l2_policy`` makes, on one device and one stream."""

    def __init__(self, set_aside=32 << 20, largest=128 << 20, limit_rc=0):
        self.attrs = {l2_policy._ATTR_MAX_PERSISTING_L2_CACHE_SIZE: set_aside,
                      l2_policy._ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE: largest}
        self.limit, self.limit_rc, self.limit_sets = 0, limit_rc, 0
        self.window = l2_policy._AttrValue()  # the stream's (none: 0 bytes)
        self.history = []  # (base, bytes, hit ratio, hit property) set on the stream

    def cuDeviceGetAttribute(self, ref, attr, idx):
        ref._obj.value = self.attrs[attr]
        return 0

    def cuCtxGetLimit(self, ref, what):
        assert what == l2_policy._LIMIT_PERSISTING_L2_CACHE_SIZE
        ref._obj.value = self.limit
        return 0

    def cuCtxSetLimit(self, what, value):
        self.limit_sets += 1
        if self.limit_rc == 0:
            self.limit = value.value
        return self.limit_rc

    def cuStreamGetAttribute(self, stream, attr, ref):
        ctypes.memmove(ctypes.addressof(ref._obj), ctypes.addressof(self.window), ctypes.sizeof(self.window))
        return 0

    def cuStreamSetAttribute(self, stream, attr, ref):
        assert attr == l2_policy._STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW
        ctypes.memmove(ctypes.addressof(self.window), ctypes.addressof(ref._obj), ctypes.sizeof(self.window))
        w = self.window.accessPolicyWindow
        self.history.append((w.base_ptr, w.num_bytes, round(w.hitRatio, 6), w.hitProp))
        return 0


def gpu_tensor(nbytes, ptr=1 << 20):
    """What ``window`` reads of a CUDA tensor, without one."""
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), data_ptr=lambda: ptr,
                           numel=lambda: nbytes // 4, element_size=lambda: 4)


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(l2_policy, "_driver", fake)
    monkeypatch.setattr(l2_policy, "_unavailable", None)
    monkeypatch.setattr(l2_policy, "_limits", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=7))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda idx: contextlib.nullcontext())
    return fake


def test_window_persists_a_share_of_the_tensor_and_restores_the_stream(driver):
    t = gpu_tensor(256 << 20)  # twice the largest window
    with l2_policy.window(t) as on:
        assert on
        # cut to the largest window; the set-aside's share of it persists
        assert driver.history[-1] == (1 << 20, 128 << 20, 0.25, l2_policy._PERSISTING)
    assert driver.history[-1][1] == 0  # the stream's previous window (none) is back
    assert driver.limit == 32 << 20 and driver.limit_sets == 1
    with l2_policy.window(gpu_tensor(16 << 20), persist=False) as on:  # (the epilogue's: lines back)
        assert on and driver.history[-1] == (1 << 20, 16 << 20, 1.0, l2_policy._NORMAL)
    with l2_policy.window(gpu_tensor(16 << 20)):
        assert driver.history[-1][2] == 1.0  # (a window within the set-aside persists whole)
    assert driver.limit_sets == 1  # (reserved once a device)


def test_window_restores_a_window_the_caller_had(driver):
    driver.window.accessPolicyWindow.base_ptr = 99
    driver.window.accessPolicyWindow.num_bytes = 4096
    with pytest.raises(RuntimeError, match="in the launch"):
        with l2_policy.window(gpu_tensor(1 << 20)):
            raise RuntimeError("in the launch")
    assert driver.history[-1][:2] == (99, 4096)


def test_window_sets_nothing_where_it_cannot(driver, monkeypatch):
    with l2_policy.window(torch.zeros(4)) as on:  # (a CPU tensor)
        assert not on
    with l2_policy.window(gpu_tensor(0)) as on:
        assert not on
    with l2_policy.window(None) as on:  # (``backward.persist_rows``: no rows to keep)
        assert not on
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with l2_policy.window(gpu_tensor(1 << 20)) as on:  # (none during a CUDA-graph capture)
        assert not on
    assert driver.history == [] and driver.limit_sets == 0

    refusing = FakeDriver(limit_rc=801)  # (MPS, for one: the limit cannot be set)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(l2_policy, "_driver", refusing)
    with l2_policy.window(gpu_tensor(1 << 20)) as on:
        assert not on
    assert refusing.history == [] and "801" in l2_policy.unavailable()

    monkeypatch.setattr(l2_policy, "_limits", {})
    monkeypatch.setattr(l2_policy, "_driver", FakeDriver(set_aside=0))
    with l2_policy.window(gpu_tensor(1 << 20)) as on:
        assert not on
    assert "no persisting L2" in l2_policy.unavailable()


def test_persist_rows_rule(monkeypatch):
    """``backward.persist_rows``: off by default; with a threshold, the accumulator's rows
    from T on where it is that many times the L2 (all rows where N <= T), else none; none on
    a CPU accumulator."""
    from dsv4_sparse_attn.kernels import backward as kbwd

    acc = torch.zeros(10, 4)  # 160 bytes
    assert kbwd.L2_PERSIST_MIN_L2 is None and kbwd.persist_rows(acc, 6, l2=1) is None
    monkeypatch.setattr(kbwd, "L2_PERSIST_MIN_L2", 4)
    rows = kbwd.persist_rows(acc, 6, l2=40)
    assert rows.data_ptr() == acc[6].data_ptr() and rows.shape == (4, 4)
    assert kbwd.persist_rows(acc, 12, l2=40).shape == (10, 4)
    assert kbwd.persist_rows(acc, 6, l2=41) is None  # (under 4x the L2)
    assert kbwd.persist_rows(acc, 6, l2=0) is None and kbwd.persist_rows(acc, 6) is None
