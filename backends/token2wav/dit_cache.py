"""A stream's DiT attention cache in a tensor of fixed width whose entries never move.

What upstream keeps (the Step-Audio2 wrapper, reproduced by ``FlowCache.truncated``): each chunk's keys
and values are *prepended* to the cache tensor (the chunk's own frames in order), and once the tensor
is longer than ``prompt_frames + recent_frames`` it is cut to its first ``prompt_frames`` and its last
``recent_frames`` entries. Number the entries by when they sit in that tensor, from the back: the
prompt's last frame is entry 0, and a chunk of n frames added after C entries holds entries
C + n - 1 (its first frame) down to C (its last). Then what upstream keeps is exactly

    entries [0, recent_frames)  and  the prompt_frames highest entries,

all of them while there are at most ``prompt_frames + recent_frames``. (A chunk longer than
``prompt_frames`` keeps only its first ``prompt_frames`` frames, as upstream's cut does.)

Why another layout: the DiT's attention has no positional encoding and masks keys only, so where an
entry sits does not matter, only which entries are kept. So the first ``recent_frames`` entries get
fixed positions, the later ones a ring of ``prompt_frames`` positions, and a chunk's frames are written
over the entries upstream drops, in place. Upstream's prepend-and-cut moved the whole cache after every
chunk (~0.66 MB per frame in fp16 at the published size, ~260 MB per stream): measured on an H100, the
prepends took ~5 ms of a 16-stream call. And a cache of fixed width, kept stream-major
([cond, uncond] outermost), copies into the engine's batch as two contiguous blocks.

Positions count down as entries are added (entry e of the first ``recent_frames`` at
``prompt_frames + recent_frames - 1 - e``, later ones cycling down through ``[0, prompt_frames)``), so
that a chunk's frames land in their own order in at most three contiguous runs, and the entries held
are always the positions ``[limit - held, limit)`` (``held_positions``): a key mask is one interval.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DiTCacheRing:
    """kv: (2, steps, depth, heads, width, 2*head_dim), [cond, uncond] outermost; width >= ``limit``.

    Positions at and beyond ``limit`` never hold an entry (padding for a common batch width); the
    positions not yet written are zeros. Owned by one stream, except a voice's (copied per stream).
    """

    kv: torch.Tensor
    prompt_frames: int
    recent_frames: int
    entries: int = 0

    @classmethod
    def from_prompt(cls, prompt_att: torch.Tensor, width: int, recent_frames: int) -> "DiTCacheRing":
        """The ring of a voice: prompt_att (steps, depth, 2, heads, prompt_frames, 2*head_dim), the
        estimator cache that ``CausalMaskedDiffWithXvec.setup_cache`` returns."""
        steps, depth, halves, heads, prompt_frames, dims = prompt_att.shape
        if width < prompt_frames + recent_frames:
            raise ValueError(f"a ring of width {width} cannot hold {prompt_frames} + {recent_frames} frames")
        ring = cls(prompt_att.new_zeros(halves, steps, depth, heads, width, dims), prompt_frames, recent_frames)
        ring.add(prompt_att.movedim(2, 0))
        return ring

    @property
    def width(self) -> int:
        return int(self.kv.shape[4])

    @property
    def limit(self) -> int:
        """Positions that ever hold entries: ``[0, limit)``."""
        return self.prompt_frames + self.recent_frames

    def held_positions(self) -> tuple[int, int]:
        """(start, stop): the positions holding the entries kept now."""
        return self.limit - min(self.entries, self.limit), self.limit

    def kept(self) -> torch.Tensor:
        """The entries kept now, as upstream's layout would hold them up to their order: a view
        (steps, depth, 2, heads, kept, 2*head_dim)."""
        start, stop = self.held_positions()
        return self.kv[..., start:stop, :].movedim(0, 2)

    def copy(self) -> "DiTCacheRing":
        """A ring of its own (one contiguous copy)."""
        return DiTCacheRing(self.kv.clone(), self.prompt_frames, self.recent_frames, self.entries)

    def position(self, entry: int) -> int:
        if entry < self.recent_frames:
            return self.limit - 1 - entry
        return self.prompt_frames - 1 - (entry - self.recent_frames) % self.prompt_frames

    def runs(self, frames: int) -> list[tuple[int, int, int]]:
        """Where a chunk of ``frames`` frames goes: (first frame, first position, length) runs, frames the
        cut would drop at once left out."""
        before, runs = self.entries, []
        for frame in range(frames):
            entry = before + frames - 1 - frame
            if entry >= self.recent_frames and entry < before + frames - self.prompt_frames:
                continue   # below the prompt_frames highest: the cut drops it (a chunk longer than the ring)
            position = self.position(entry)
            if runs and runs[-1][0] + runs[-1][2] == frame and runs[-1][1] + runs[-1][2] == position:
                runs[-1][2] += 1
            else:
                runs.append([frame, position, 1])
        return [tuple(run) for run in runs]

    def add(self, new: torch.Tensor) -> None:
        """Add a chunk's keys/values, new (2, steps, depth, heads, frames, 2*head_dim) (a view is fine),
        over the entries upstream would drop."""
        frames = int(new.shape[4])
        for frame, position, length in self.runs(frames):
            self.kv.narrow(4, position, length).copy_(new.narrow(4, frame, length))
        self.entries += frames

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
