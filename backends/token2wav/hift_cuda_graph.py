"""CUDA-graph replay of the HiFT decoder, one graph per input shape.

Why: at batch 1 the decoder is launch-bound. Measured on an H100 (fp16, 58 mel frames): ~2.8 ms of
GPU work but ~20 ms of wall time, because one call launches ~85 convolutions and ~700 small pointwise
kernels (the Snake activations) from Python. Replaying a captured graph removes that CPU cost.

Only `decode` is graphed: the excitation draws random numbers from a caller-owned generator (which a
graph would freeze) and is cheap. The graphs are ``cuda_graph.GraphedCall``'s (keyed by the exact
shapes; captured on a shape's second sighting; never evicted: an LRU that destroyed graphs while batched
shapes churned preceded an illegal memory access at 64 streams on an H100; one shared memory pool, whose
growth counts against ``max_bytes``; no capture without free memory to spare). What this adds: batches
are padded to a power of two, so streams vocoded together in any count use a few graphs, at most
``max_shapes`` of them, and each output is cloned, so callers may keep it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from backends.token2wav.cuda_graph import GraphedCall


class GraphedDecode:
    """Callable like `decode(mel, source) -> wav` that replays a CUDA graph per shape."""

    def __init__(self, decode: Callable[[Tensor, Tensor], Tensor], max_shapes: int = 4, warmup_runs: int = 2,
                 capture_after: int = 2, max_bytes: int = 4 << 30) -> None:
        if max_shapes < 1 or capture_after < 1:
            raise ValueError("max_shapes and capture_after must be at least 1")
        self._decode = decode
        self._graphed = GraphedCall(decode, max_bytes=max_bytes, capture_after=capture_after,
                                    warmup_runs=warmup_runs, max_graphs=max_shapes)

    @property
    def num_graphs(self) -> int:
        return self._graphed.num_graphs

    @property
    def graph_bytes(self) -> int:
        return self._graphed.graph_bytes

    @property
    def eager_runs(self) -> int:
        return self._graphed.eager_runs

    def __call__(self, mel: Tensor, source: Tensor, capture: bool = True) -> Tensor:
        """``capture=False``: replay an existing graph or run eagerly (``GraphedCall.replay_only``)."""
        if not mel.is_cuda:
            return self._decode(mel, source)
        batch = mel.shape[0]
        rows = 1 << (batch - 1).bit_length()
        if rows != batch:
            # Pad the batch to a power of two with copies of row 0 (their output is dropped): streams
            # vocoded together come in every count, graphs only in a few (rows are independent in decode).
            mel = torch.cat([mel, mel[:1].expand(rows - batch, *mel.shape[1:])])
            source = torch.cat([source, source[:1].expand(rows - batch, *source.shape[1:])])
        graphed = self._graphed if capture else self._graphed.replay_only
        return graphed(mel, source)[:batch].clone()
