"""CUDA-graph replay of the flow's per-chunk work: the conformer encoder and the 10-step estimator solve.

Why: measured on an H100 host (fp16, eager, one 100-token chunk): ~8 700 kernel launches, ~38 ms of GPU
work but ~200 ms of wall time, because each of the 10 Euler steps runs 16 DiT blocks of ~50 small
kernels from Python (the encoder adds ~20-60 ms of the same). A graph replays a whole call with one
launch.

``GraphedCall`` wraps a function of tensors (plus hashable non-tensor arguments such as the step count)
and keys its graphs by the exact shapes and dtypes of the tensor arguments. The engine keeps the shapes
few (canonical chunk sizes, estimator caches padded to one length per voice prompt length, batches padded
to a power of two); a shape is captured only the ``capture_after``-th time it is seen, so one-off shapes
(a final remainder) run eagerly instead of paying a capture.

Memory: the graphs of one ``GraphedCall`` share what can be shared, because their replays never overlap
(a lock) and a caller copies the outputs it keeps before the next call:
- static input buffers, per (argument position, shape, dtype): the solve's attention caches (~0.66 MB per
  cached frame per stream in fp16 at the published size) are the same tensor for every chunk size;
- one memory pool for everything the captures allocate, so a graph's intermediates reuse another's.
What a capture adds (measured: reserved memory before and after) counts against ``max_bytes``; once
reached, or when free GPU memory runs short (``room_to_capture``), new shapes run eagerly. There is no
eviction: evicting and recapturing the shapes of one schedule in turn cost more than it saved (measured
on an H100).

Outputs are the graph's static buffers, and with the shared pool another graph's replay may reuse their
memory: the caller must copy what it keeps before the next call (``Token2WavEngine`` copies each stream's
rows out when it splits a batch). A lock serialises replays.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[Tensor]          # static copies of the tensor arguments, in order
    outputs: Any                  # what the function returned during capture (static buffers)
    nbytes: int


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (tuple, list)):
        return sum(_nbytes(t) for t in tensors)
    return 0


CAPTURE_HEADROOM = 2 << 30
"""Free GPU memory (bytes, besides what a capture needs) below which no graph is captured."""


def room_to_capture(device: torch.device, needed: int = 0) -> bool:
    """Whether a capture can allocate without running out of memory.

    Why: an allocation failure in the middle of a capture leaves the graph and its memory pool half
    made; running eagerly when memory is short costs time, not correctness. Counts memory the driver
    has free plus what torch's allocator holds unused.
    """
    free, _ = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + unused >= needed + CAPTURE_HEADROOM


def zeros_in_memory_order(shape: tuple[int, ...], order: tuple[int, ...], dtype: torch.dtype,
                          device: torch.device) -> Tensor:
    """Zeros of ``shape`` whose dimensions lie in memory in ``order`` (outermost first): a permuted view
    of a contiguous allocation (``order`` = 0, 1, ... is an ordinary contiguous tensor)."""
    physical = torch.zeros(tuple(shape[d] for d in order), dtype=dtype, device=device)
    return physical.permute(tuple(order.index(d) for d in range(len(order))))


class GraphedCall:
    """``fn(*args)`` replayed from a CUDA graph per shape of its tensor arguments (eager on the CPU)."""

    def __init__(self, fn: Callable[..., Any], max_bytes: int = 16 << 30, capture_after: int = 2,
                 warmup_runs: int = 1, max_graphs: int | None = None) -> None:
        if capture_after < 1 or (max_graphs is not None and max_graphs < 1):
            raise ValueError("capture_after and max_graphs must be at least 1")
        self._fn = fn
        self._max_bytes = max_bytes
        self._max_graphs = max_graphs
        self._capture_after = capture_after
        self._warmup_runs = warmup_runs
        self._graphs: dict[tuple, _Captured] = {}
        self._seen: Counter[tuple] = Counter()
        self._statics: dict[tuple, Tensor] = {}   # (position, shape, dtype, device) -> shared input buffer
        self._pool: Any = None                     # one memory pool for all captures (made on first use)
        self._lock = threading.Lock()
        self.graph_bytes = 0
        self.replays = 0
        self.eager_runs = 0

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, *args: Any) -> Any:
        return self._call(args, capture=True)

    def replay_only(self, *args: Any) -> Any:
        """Replay a graph this shape already has, else run eagerly; never captures one.

        For shapes too varied to be worth a graph each (a stream's last chunk has any length): their
        graphs are captured deliberately (a warm-up), never on a request's time."""
        return self._call(args, capture=False)

    def _call(self, args: tuple, capture: bool) -> Any:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if not tensors or not tensors[0].is_cuda:
            return self._fn(*args)
        key = tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else ("value", a) for a in args)
        with self._lock:
            captured = self._graphs.get(key)
            if captured is None and not capture:
                self.eager_runs += 1
                return self._fn(*args)
            if captured is None:
                self._seen[key] += 1
                # What a capture surely adds: input buffers no other graph shares. (Outputs and pool growth
                # are measured afterwards; the free-memory headroom covers them meanwhile.)
                estimate = _nbytes([a for i, a in enumerate(args) if isinstance(a, Tensor)
                                    and self._static_key(i, a) not in self._statics])
                full = self._max_graphs is not None and len(self._graphs) >= self._max_graphs
                if (self._seen[key] < self._capture_after or full or self.graph_bytes + estimate > self._max_bytes
                        or not room_to_capture(tensors[0].device, estimate)):
                    self.eager_runs += 1
                    return self._fn(*args)
                captured = self._capture(args)
                self._graphs[key] = captured
            for static, value in zip(captured.inputs, tensors):
                if static is not value:   # a caller may have written it in place (``input_buffer``)
                    static.copy_(value)
            captured.graph.replay()
            self.replays += 1
            return captured.outputs

    def input_buffer(self, position: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     memory_order: tuple[int, ...] | None = None) -> Tensor:
        """The shared static buffer for argument ``position`` of this shape, for the caller to fill in place
        and pass as that argument: the replay then skips copying it in.

        Why: the solve's attention caches are its largest input (4.2 GB at 16 streams x 400 frames in
        fp16 on the published size); assembling the batch elsewhere and copying it in moved it twice
        (measured on an H100: ~3 ms of a 16-stream first-chunk call, plus zeroing the batch). A new
        buffer is zeros and counts against ``max_bytes``; what it holds between calls is the previous
        caller's data (the caller masks what it does not overwrite). ``memory_order``: how its dimensions
        lie in memory (``zeros_in_memory_order``); one caller of a buffer always asks for the same.
        """
        key = (position, tuple(shape), dtype, device)
        with self._lock:
            buffer = self._statics.get(key)
            if buffer is None:
                order = memory_order or tuple(range(len(shape)))
                buffer = self._statics[key] = zeros_in_memory_order(shape, order, dtype, device)
                self.graph_bytes += _nbytes(buffer)
            return buffer

    @staticmethod
    def _static_key(position: int, tensor: Tensor) -> tuple:
        return position, tuple(tensor.shape), tensor.dtype, tensor.device

    def _capture(self, args: tuple) -> _Captured:
        device = next(a for a in args if isinstance(a, Tensor)).device
        reserved_before = torch.cuda.memory_reserved(device)
        statics = []
        for position, arg in enumerate(args):
            if isinstance(arg, Tensor):
                buffer = self._statics.get(self._static_key(position, arg))
                if buffer is None:
                    buffer = self._statics[self._static_key(position, arg)] = arg.clone()
                elif buffer is not arg:
                    buffer.copy_(arg)
                arg = buffer
            statics.append(arg)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # Warm up on a side stream (lazy inits, library handles) before capturing, as torch advises.
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self._warmup_runs):
                self._fn(*statics)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._fn(*statics)
        nbytes = max(0, torch.cuda.memory_reserved(device) - reserved_before)
        self.graph_bytes += nbytes
        inputs = [a for a in statics if isinstance(a, Tensor)]
        return _Captured(graph, inputs, outputs, nbytes)
