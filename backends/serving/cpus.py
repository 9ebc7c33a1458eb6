"""Sharing a small machine between the LLM server and token2wav.

vLLM's CPU backend busy-polls: its engine-core process and its OpenMP worker threads keep cores at
100 % even while idle, and its default binds workers to every core. Next to it, token2wav's torch
threads starved on 2 cores: a first chunk took 31 s instead of 0.1 s and Triton declared its python
stub unhealthy (then the server died). Pinning vLLM's whole process tree to one half of the cores
and Triton to the other half (measured: the same chunk in 0.37 s while vLLM generated) fixes it.
On machines with more than 8 cores, or a single core, nothing is pinned.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection


def shared_machine_split() -> tuple[frozenset[int], frozenset[int]] | None:
    """(LLM cores, token2wav cores) for this machine, or None when no pinning is wanted."""
    available = sorted(os.sched_getaffinity(0))
    if not 2 <= len(available) <= 8:
        return None
    half = len(available) // 2
    return frozenset(available[half:]), frozenset(available[:half])


def pin_to(cores: Collection[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that restricts the child (and so its children) to ``cores``."""
    if not cores:
        return None
    chosen = set(cores)
    return lambda: os.sched_setaffinity(0, chosen)


def core_list(cores: Collection[int]) -> str:
    """``"1"`` or ``"0,2,3"``: the form ``VLLM_CPU_OMP_THREADS_BIND`` takes."""
    return ",".join(str(c) for c in sorted(cores))
