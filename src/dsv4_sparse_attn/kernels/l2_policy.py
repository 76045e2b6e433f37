"""The L2's persisting set-aside for the fast backward at long contexts.

Where the fp32 [N, D] dKV accumulator is several times the L2 (T = 131072: 335 MB against
the H100's 50 MB, the H200's 60), the fast mode's reductions miss the L2, and a reduction
that misses costs a line read and a dirty line written back, where a gather that misses
costs one read. An access-policy window over the accumulator on the main kernel's launch
keeps a share of its lines in the L2's persisting set-aside, ahead of kv's and q/dO's
(docs/performance/backward.md#the-accumulator-in-the-l2s-persisting-set-aside).

The window is a stream attribute (the launch takes it when enqueued: later launches do not
see it once restored); the set-aside is a context-wide limit, reserved the first time a
window is used and left reserved; the lines are given back by the epilogue, whose launch
reads every accumulator row under a window that resets them to normal. Through the driver
API (ctypes; Triton's launcher takes no launch attributes). Where the driver refuses (MPS,
MIG, no libcuda), and during a CUDA-graph capture, nothing is set.

Measured on the H200, why the backward leaves this off (``backward.L2_PERSIST_MIN_L2``):
reserving the set-aside (``cuCtxSetLimit``) waits for the device to go idle, and while it
is reserved normal lines do not get it back (mid-sized fast backward calls without a window
took 40-46% longer), though the programming guide says they use it while no persisting
line does.
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator, Optional

import torch

# CUDA driver API constants (cuda.h)
_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
_NORMAL, _PERSISTING = 0, 2  # (CUaccessProperty)
_ATTR_MAX_PERSISTING_L2_CACHE_SIZE = 108
_ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE = 109


class _Window(ctypes.Structure):  # CUaccessPolicyWindow
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hitRatio", ctypes.c_float),
                ("hitProp", ctypes.c_int), ("missProp", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # CUstreamAttrValue (= CUlaunchAttributeValue, 64 bytes)
    _fields_ = [("accessPolicyWindow", _Window), ("pad", ctypes.c_char * 64)]


_driver: Optional[ctypes.CDLL] = None
_unavailable: Optional[str] = None  # why no window is set in this process (None: not known yet / fine)
_limits: dict = {}  # device index -> (set-aside bytes, largest window bytes)


def _lib() -> Optional[ctypes.CDLL]:
    global _driver, _unavailable
    if _driver is None and _unavailable is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            _unavailable = f"no CUDA driver library ({e})"
    return _driver


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(set-aside bytes, largest window bytes) for ``device``, the set-aside reserved at its
    largest on first use; (0, 0) where the driver refuses."""
    global _unavailable
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _limits:
        return _limits[idx]
    lib = _lib()
    got = (0, 0)
    if lib is not None:
        persist, window = ctypes.c_int(), ctypes.c_int()
        get = lib.cuDeviceGetAttribute
        ok = (get(ctypes.byref(persist), _ATTR_MAX_PERSISTING_L2_CACHE_SIZE, idx) == 0
              and get(ctypes.byref(window), _ATTR_MAX_ACCESS_POLICY_WINDOW_SIZE, idx) == 0)
        if ok and persist.value > 0 and window.value > 0:
            cur = ctypes.c_size_t()
            with torch.cuda.device(idx):  # (the limit is the current context's)
                rc = lib.cuCtxGetLimit(ctypes.byref(cur), _LIMIT_PERSISTING_L2_CACHE_SIZE)
                if rc == 0 and cur.value < persist.value:
                    rc = lib.cuCtxSetLimit(_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(persist.value))
            if rc == 0:
                got = (persist.value, window.value)
            else:
                _unavailable = f"the persisting L2 limit could not be set (CUresult {rc})"
        else:
            _unavailable = "the device reports no persisting L2"
    _limits[idx] = got
    return got


def _set_window(stream: torch.cuda.Stream, value: _AttrValue) -> bool:
    return _lib().cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream),
                                       _STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(value)) == 0


def _get_window(stream: torch.cuda.Stream) -> Optional[_AttrValue]:
    v = _AttrValue()
    rc = _lib().cuStreamGetAttribute(ctypes.c_void_p(stream.cuda_stream),
                                     _STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, ctypes.byref(v))
    return v if rc == 0 else None


@contextlib.contextmanager
def window(t: Optional[torch.Tensor], persist: bool = True) -> Iterator[bool]:
    """The launches enqueued inside run with an access-policy window over ``t``'s bytes (a
    contiguous tensor, cut to the largest window; None: no window): ``persist`` puts a share
    of its lines in the persisting set-aside (the set-aside over the window's bytes),
    ``persist=False`` gives every line it touches back to normal. Yields whether the window
    is set; the stream's previous window is restored after."""
    # (not during a CUDA-graph capture: whether a stream attribute is taken into the
    # captured kernel nodes, and whether setting one is legal there, is not measured)
    if t is None or not t.is_cuda or t.numel() == 0 or torch.cuda.is_current_stream_capturing():
        yield False
        return
    set_aside, largest = _device_limits(t.device)
    stream = torch.cuda.current_stream(t.device)
    prev = _get_window(stream) if set_aside else None
    if prev is None:
        yield False
        return
    v = _AttrValue()
    w = v.accessPolicyWindow
    w.base_ptr, w.num_bytes = t.data_ptr(), min(largest, t.numel() * t.element_size())
    w.hitRatio = min(1.0, set_aside / w.num_bytes) if persist else 1.0
    w.hitProp, w.missProp = (_PERSISTING if persist else _NORMAL), _NORMAL
    ok = _set_window(stream, v)
    try:
        yield ok
    finally:
        if ok:
            _set_window(stream, prev)


def unavailable() -> Optional[str]:
    """Why no window is set in this process (None: none refused so far)."""
    return _unavailable
