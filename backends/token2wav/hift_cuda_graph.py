"""CUDA-graph replay of the HiFT decoder, one graph per input shape.

Why: at batch 1 the decoder is launch-bound. Measured on an H100 (fp16, 58 mel frames): ~2.8 ms of
GPU work but ~20 ms of wall time, because one call launches ~85 convolutions and ~700 small pointwise
kernels (the Snake activations) from Python. Replaying a captured graph removes that CPU cost.

Only `decode` is graphed: the excitation draws random numbers from a caller-owned generator (which a
graph would freeze) and is cheap. Graphs are keyed by (mel shape, source shape, dtype); streaming uses
a handful of chunk sizes and batches are padded to a power of two. As in ``cuda_graph.GraphedCall``, a
shape is captured the second time it is seen (one-off shapes such as a final remainder run eagerly),
and once ``max_shapes`` graphs exist, or their memory pools reach ``max_bytes``, new shapes run eagerly:
graphs are never evicted. (An LRU that
destroyed graphs, each with its private memory pool, while batched shapes churned preceded an illegal
memory access at 64 streams on an H100.) No capture starts without free memory to spare either. A lock
serialises replays because the static input/output buffers belong to the graph, not to the call.

All graphs capture into one memory pool: a decode's activations dominate its memory (~1.5 GB at batch
8 x 200 frames, fp16), replays never overlap, and each replay's output is cloned before the next, so
one graph's activations may reuse another's memory.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from backends.token2wav.cuda_graph import room_to_capture


@dataclass
class _CapturedDecode:
    graph: torch.cuda.CUDAGraph
    mel: Tensor
    source: Tensor
    wav: Tensor


class GraphedDecode:
    """Callable like `decode(mel, source) -> wav` that replays a CUDA graph per shape."""

    def __init__(self, decode: Callable[[Tensor, Tensor], Tensor], max_shapes: int = 4, warmup_runs: int = 2,
                 capture_after: int = 2, max_bytes: int = 4 << 30) -> None:
        if max_shapes < 1 or capture_after < 1:
            raise ValueError("max_shapes and capture_after must be at least 1")
        self._decode = decode
        self._max_shapes = max_shapes
        self._warmup_runs = warmup_runs
        self._capture_after = capture_after
        self._max_bytes = max_bytes
        self.graph_bytes = 0
        self._pool: object = None  # shared by every capture (made on first use)
        self._graphs: dict[tuple, _CapturedDecode] = {}
        self._seen: Counter[tuple] = Counter()
        self._lock = threading.Lock()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, mel: Tensor, source: Tensor) -> Tensor:
        if not mel.is_cuda:
            return self._decode(mel, source)
        batch = mel.shape[0]
        rows = 1 << (batch - 1).bit_length()
        if rows != batch:
            # Pad the batch to a power of two with copies of row 0 (their output is dropped): streams
            # vocoded together come in every count, graphs only in a few (rows are independent in decode).
            mel = torch.cat([mel, mel[:1].expand(rows - batch, *mel.shape[1:])])
            source = torch.cat([source, source[:1].expand(rows - batch, *source.shape[1:])])
            return self(mel, source)[:batch]
        key = (tuple(mel.shape), tuple(source.shape), mel.dtype, source.dtype, mel.device)
        with self._lock:
            captured = self._graphs.get(key)
            if captured is None:
                self._seen[key] += 1
                if (self._seen[key] < self._capture_after or len(self._graphs) >= self._max_shapes
                        or self.graph_bytes >= self._max_bytes or not room_to_capture(mel.device)):
                    return self._decode(mel, source)
                captured = self._capture(mel, source)
                self._graphs[key] = captured
            captured.mel.copy_(mel)
            captured.source.copy_(source)
            captured.graph.replay()
            return captured.wav.clone()

    def _capture(self, mel: Tensor, source: Tensor) -> _CapturedDecode:
        # Count what the capture reserved (activations beyond what the shared pool already had) against max_bytes.
        reserved_before = torch.cuda.memory_reserved(mel.device)
        captured = self._capture_graph(mel, source)
        self.graph_bytes += max(0, torch.cuda.memory_reserved(mel.device) - reserved_before)
        return captured

    def _capture_graph(self, mel: Tensor, source: Tensor) -> _CapturedDecode:
        static_mel, static_source = mel.clone(), source.clone()
        # Warm up on a side stream (cuDNN algorithm choice, lazy inits) before capturing, as torch advises.
        side = torch.cuda.Stream(device=mel.device)
        side.wait_stream(torch.cuda.current_stream(mel.device))
        with torch.cuda.stream(side):
            for _ in range(self._warmup_runs):
                self._decode(static_mel, static_source)
        torch.cuda.current_stream(mel.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static_wav = self._decode(static_mel, static_source)
        return _CapturedDecode(graph, static_mel, static_source, static_wav)
