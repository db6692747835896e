"""What both GPU executors share: the attention shapes they run, plan checks, host-to-device
uploads that never wait, reusable scratch buffers, and the registry of live executors (for the
memory and graph counters). Imported only in vLLM workers (torch at the top)."""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..planning.graph_layout import buffer_elements
from ..planning.plan import CascadePlan

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# The FP8 cache format the executors read with per-layer scales (vLLM's fp8 / fp8_e4m3).
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value: vLLM's FP8 quantisation saturates to it


@dataclass(frozen=True)
class KvScales:
    """One layer's FP8 scales, as vLLM keeps them on its Attention layer: the stored value
    times its scale is the real one (``k = k_cache * k``). Tensors: float32, one element, on
    the device (``layer._q_scale`` ...; FlashAttention's descales, read when a kernel runs);
    floats: the same values on the host (``layer._q_scale_float`` ..., FlashInfer's)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_float: float
    k_float: float
    v_float: float

    @classmethod
    def of_layer(cls, layer: Any) -> KvScales:
        return cls(layer._q_scale, layer._k_scale, layer._v_scale,
                   float(layer._q_scale_float), float(layer._k_scale_float),
                   float(layer._v_scale_float))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v


def quantise_fp8(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to e4m3's range and rounded into ``out`` (FP8), as vLLM's static
    per-tensor ``QuantFP8`` quantises a query for FlashAttention."""
    out.copy_((x.float() / scale).clamp_(-FP8_MAX, FP8_MAX))
    return out
# merge_state_in_place launches blockDim = (head_dim / vec, num_qo_heads); CUDA allows 1024.
MAX_MERGE_THREADS = 1024


def unsupported_reason(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    *,
    window_left: int = -1,
) -> str | None:
    """Why the executor cannot run this attention configuration, or None when it can.

    The caller falls back to flat attention on a reason instead of crashing in a kernel launch
    or, worse, computing wrong values silently.
    """
    if head_dim not in SUPPORTED_HEAD_DIMS:
        # FA2 prefill misbehaves for other sizes (FlashInfer #4299); FA3 compiles only these.
        return f"head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads:
        return f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if q_dtype not in SUPPORTED_DTYPES:
        return f"query dtype {q_dtype} not in {SUPPORTED_DTYPES} (merge kernel)"
    if kv_dtype != q_dtype and kv_dtype != FP8_KV_DTYPE:
        # run() applies scales to an e4m3 cache only; any other would be read unscaled.
        return f"KV cache dtype {kv_dtype} differs from query dtype {q_dtype}"
    vec = max(16 // q_dtype.itemsize, head_dim // 32)
    threads = num_qo_heads * head_dim // vec
    if threads > MAX_MERGE_THREADS:
        return f"merge kernel needs {threads} threads per block (> {MAX_MERGE_THREADS})"
    if window_left >= 0:
        # The sliding-window mask is evaluated per level segment, so cascade would be wrong.
        return "sliding-window attention"
    return None


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """A layer's attention sinks on its merged cascade output, in place.

    A sink adds ``exp(sink[h])`` once to head ``h``'s softmax denominator (gpt-oss: vLLM's
    FlashAttention takes it as ``s_aux``). The levels' merge gives ``out = sum_k p_k v_k / S`` and
    ``lse = log S`` over every key of the row; with the sink the denominator is ``S + exp(sink)``,
    so ``out`` scales by ``S / (S + exp(sink)) = sigmoid(lse - sink)``: the sink enters the
    softmax exactly once, whichever levels the row's keys were split into. ``lse``: natural log,
    ``[rows, heads]`` for the first ``rows`` rows of ``out`` (``[rows, heads, head_dim]``);
    scaled in float32, rounded once to ``out``'s dtype. ``sinks`` None: nothing to do.
    """
    if sinks is None:
        return
    rows = lse.shape[0]
    scale = torch.sigmoid(lse - sinks.to(torch.float32))
    out[:rows].copy_(out[:rows].float() * scale.unsqueeze(-1))


def check_plan(plan: CascadePlan, page_size: int, max_levels: int) -> None:
    if plan.page_size != page_size:
        raise ValueError(f"plan page size {plan.page_size} != cache page size {page_size}")
    if not 1 <= plan.num_levels <= max_levels:
        raise ValueError(f"plan has {plan.num_levels} levels; 1..{max_levels} supported")
    last = plan.levels[-1]
    if not (last.causal and last.q_is_identity):
        raise ValueError("the last level must be causal and cover the queries in step order")
    if any(level.causal for level in plan.levels[:-1]):
        raise ValueError("shared levels must not be causal")


class StagingClock:
    """Host seconds the executors spent staging plans for the device: copies of their arrays
    into pinned host memory and the launches of the uploads (CUDA calls, which can wait on the
    driver), as against the rest of planning an executor (Python and numpy).
    ``launch_seconds``: the part of ``seconds`` spent in the launches."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.launch_seconds = 0.0
        self._depth = 0  # timed() blocks entered and not left: the outermost one counts

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        start = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.seconds += time.perf_counter() - start

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.launch_seconds += time.perf_counter() - start


STAGING = StagingClock()  # the metadata builders read it around each executor's plan()


def pinned(array: np.ndarray, dtype: type[np.integer]) -> torch.Tensor:
    # Host tensors keep FlashInfer's plan free of device->host copies; pinned ones make the
    # non_blocking uploads (FlashInfer's and ours) truly asynchronous, and torch's pinned-memory
    # allocator does not reuse a block before its copy has run. np.require copies only when
    # needed: from_numpy warns on read-only arrays, and the planner may freeze its output.
    return torch.from_numpy(np.require(array, dtype, ("C", "W"))).pin_memory()


class PinnedRing:
    """Pinned host buffers that uploads are staged in, taken in turn: a buffer is written
    again only once the copies that last read it have run (a CUDA event per buffer, which has
    long run by then: the ring holds ``SLOTS`` stagings, several steps' worth). Used by the
    builders' thread only.

    The buffers are allocated once (grown when a staging is larger), so a step's uploads cost
    a host copy and a launch each. ``pin_memory()`` instead takes a block of torch's caching
    host allocator per upload, which it may have to allocate (page-locking, milliseconds)
    while the blocks of the last steps' copies are still in flight.
    """

    SLOTS = 8
    MIN_BYTES = 1 << 16

    def __init__(self) -> None:
        self._host: list[torch.Tensor | None] = [None] * self.SLOTS  # uint8, pinned
        self._events: list[Any] = [None] * self.SLOTS
        self._next = 0
        self.waits = 0  # stagings that found their buffer's last copies not yet run
        self.allocations = 0

    @contextlib.contextmanager
    def staged(self, arrays: list[np.ndarray], dtype: torch.dtype) -> Iterator[list[torch.Tensor]]:
        """Pinned host tensors of ``dtype`` holding ``arrays`` (each 16-byte aligned), for the
        block's non-blocking copies on the current stream, which an event then guards."""
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        event = self._events[slot]
        with STAGING.timed():
            if event is not None and not event.query():
                self.waits += 1
                event.synchronize()
            itemsize = dtype.itemsize
            starts, end = [], 0
            for array in arrays:
                starts.append(end)
                end += -(-array.size * itemsize // 16) * 16
            host = self._host[slot]
            if host is None or host.numel() < end:
                size = max(self.MIN_BYTES, 1 << max(end - 1, 0).bit_length())
                host = self._host[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                self.allocations += 1
            views = []
            for array, start in zip(arrays, starts, strict=True):
                view = host[start:start + array.size * itemsize].view(dtype)
                view.numpy()[:] = array.ravel()
                views.append(view)
        try:
            yield views
        finally:  # also after a failure: copies the block launched may still read the buffer
            with STAGING.timed(), STAGING.launching():
                if event is None:
                    event = self._events[slot] = torch.cuda.Event()
                event.record(torch.cuda.current_stream())

    def copy(self, dest: torch.Tensor, array: np.ndarray) -> None:
        """``array`` into the first ``array.size`` elements of ``dest`` (contiguous, on the
        current GPU, of ``array``'s dtype) on the current stream, without waiting for it."""
        with self.staged([array], dest.dtype) as (staged,), STAGING.launching():
            dest[:array.size].copy_(staged, non_blocking=True)


_RINGS: dict[Any, PinnedRing] = {}  # by device


def ring_for(device: torch.device) -> PinnedRing:
    """The :class:`PinnedRing` of ``device`` (a GPU, the current one)."""
    key = torch.device(device.type, torch.cuda.current_device() if device.index is None
                       else device.index)
    ring = _RINGS.get(key)
    if ring is None:
        ring = _RINGS[key] = PinnedRing()
    return ring


_NUMPY_DTYPES: dict[torch.dtype, type[np.integer]] = {torch.int32: np.int32,
                                                      torch.int64: np.int64}


@contextlib.contextmanager
def staged(arrays: list[np.ndarray], dtype: torch.dtype,
           device: torch.device) -> Iterator[list[torch.Tensor]]:
    """Pinned host tensors of ``dtype`` holding ``arrays``, for the block's non-blocking copies
    to ``device`` (the current GPU) on the current stream; the staging is timed by
    :data:`STAGING`. From the device's :class:`PinnedRing`; while a CUDA-graph capture is
    underway (it records no event of ours), from ``pin_memory()``, whose blocks torch's
    allocator keeps until their copies have run."""
    if not torch.cuda.is_current_stream_capturing():
        with ring_for(device).staged(arrays, dtype) as views:
            yield views
        return
    with STAGING.timed():
        views = [pinned(array.ravel(), _NUMPY_DTYPES[dtype]) for array in arrays]
    yield views


def copy_to_device(dest: torch.Tensor, array: np.ndarray, dtype: type[np.integer]) -> None:
    """``array`` as ``dtype`` into the start of ``dest`` without waiting for the copy, staged
    in pinned memory (:func:`staged`); on a CPU a plain copy (the CPU tests of the FA3
    executor)."""
    if dest.device.type == "cpu":
        dest[:array.size].copy_(torch.from_numpy(np.array(array, dtype).ravel()))
        return
    with STAGING.timed():
        host = np.asarray(array, dtype)
        with staged([host], dest.dtype, dest.device) as (view,), STAGING.launching():
            dest[:host.size].copy_(view, non_blocking=True)


_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def upload(array: np.ndarray, dtype: type[np.integer], device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without waiting: staged in pinned memory, copied non-blocking."""
    if device.type == "cpu":  # the CPU tests of the FA3 executor
        return torch.from_numpy(np.array(array, dtype))
    dest = torch.empty(array.shape, dtype=_TORCH_DTYPES[np.dtype(dtype)], device=device)
    copy_to_device(dest.view(-1), array, dtype)
    return dest


def device_index(q_index: np.ndarray, device: torch.device) -> torch.Tensor:
    # int64: index_copy_ accepts no other index dtype.
    return upload(q_index, np.int64, device)


def same_device(have: torch.device, want: torch.device) -> bool:
    """``cuda:0`` is ``cuda`` when device 0 is the current one (``!=`` says they differ)."""
    if have.type != want.type:
        return False
    if want.index is None and want.type == "cuda":
        return have.index == torch.cuda.current_device()
    return want.index is None or have.index == want.index


class Scratch:
    """Device buffers reused by every layer and step; grown (never shrunk) on demand."""

    MAX_VIEWS = 4096  # views kept for reuse (steps of the same shapes take the same views)

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # Views handed out, by (name, shape, dtype, device): a step takes ~10 and making one
        # costs microseconds of torch's Python. Dropped with their buffer when it is replaced.
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        # What callers made of the buffers (views of several, by their own key): emptied when
        # a buffer is replaced, so that nothing keeps an old one alive.
        self.memo: dict[Any, Any] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device, reserve: int = 0) -> torch.Tensor:
        """A contiguous view of ``shape`` at the start of buffer ``name``.

        Views of one name share memory: give one name only to users that run one after another.
        ``reserve``: elements to allocate at least, when the buffer is allocated (a graphed
        step's buffers are sized at once for the largest step its graphs can run, so that they
        never move and orphan the graphs captured before).
        """
        key = (name, shape, dtype, device)
        view = self._views.get(key)
        if view is not None:
            return view
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if (buf is None or buf.numel() < numel or buf.dtype != dtype
                or not same_device(buf.device, device)):
            buf = torch.empty(max(buffer_elements(numel), reserve), dtype=dtype, device=device)
            self._buffers[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
            self.memo.clear()
        if len(self._views) >= self.MAX_VIEWS:
            self._views.clear()
        if len(self.memo) >= self.MAX_VIEWS:
            self.memo.clear()
        view = self._views[key] = buf[:numel].view(shape)
        return view

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


EXECUTORS: weakref.WeakSet[Any] = weakref.WeakSet()  # every live executor
KERNELS = ("flashinfer", "fa3")
LOG2_E = 1.4426950408889634  # FlashInfer's LSE is base 2, FlashAttention's natural
