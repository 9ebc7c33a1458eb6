"""The DiT step's elementwise work as small tensor functions, compiled into fused kernels on a GPU.

Why: with the GEMMs and attention done by cuBLAS/cuDNN, what was left of a batched estimator step on
an H100 was memory-bound glue (measured, 16 streams x 100 tokens, eager: copies, layer norms, addcmuls
and cats took ~85 of the round's ~150 ms of GPU time, the layer norms alone 26 ms in 833 calls). Each
function here is one such group (a gated residual plus the next adaLN norm, the q/k norms plus the
KV-cache concatenation, a conv's shifted frames, ...), which ``torch.compile`` turns into one or two
generated kernels.

Each function is ordinary eager PyTorch, and that is what runs unless ``use_compiled(True)`` was
called (the engine does, on a GPU, when ``compile_fused`` is set): the CPU tests run the same code the
GPU compiles. Compilation happens on the first calls (the engine's warm-up): torch.compile's automatic
dynamic shapes compile a function for its first shapes, then once more with the dimensions that
changed (batch, frames) symbolic; channel dimensions stay fixed. (``dynamic=True`` made every dimension
symbolic, and its generated norms and concatenations ran slower than eager ones, measured on an H100.)
The generated kernels are captured into the solve's CUDA graphs like any other kernel.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Optional, TypeVar

import torch
import torch.nn.functional as F

Fn = TypeVar("Fn", bound=Callable)

_state = {"compiled": False}
_lock = threading.Lock()


def use_compiled(enabled: bool) -> None:
    """Run the functions below through torch.compile (CUDA tensors only; CPU tensors stay eager)."""
    if enabled:
        import torch._inductor.config as inductor_config

        # No compile worker processes: the Triton python stub is no place to fork a pool, and the few
        # small kernels here compile quickly in-process.
        inductor_config.compile_threads = 1
    _state["compiled"] = enabled


def is_compiled() -> bool:
    """Whether ``use_compiled(True)`` is in effect."""
    return _state["compiled"]


def compiled_on_gpu(fn: Fn) -> Fn:
    """``fn`` eagerly, or (after ``use_compiled(True)``, for CUDA tensors) its torch.compile'd form."""
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args):
        if not (_state["compiled"] and args[0].is_cuda):
            return fn(*args)
        if not compiled:
            with _lock:
                if not compiled:
                    compiled.append(torch.compile(fn, fullgraph=True))
        return compiled[0](*args)

    return call  # type: ignore[return-value]


@compiled_on_gpu
def modulated_norm(x: torch.Tensor, scale_plus_one: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """``LayerNorm(x) * (1 + scale) + shift`` (the DiT's adaLN): the modulation is the norm's affine.

    The modulation depends only on the timestep, which every row of a solve shares.
    """
    return F.layer_norm(x, (x.shape[-1],), scale_plus_one, shift, eps)


@compiled_on_gpu
def gated_norm(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, scale_plus_one: torch.Tensor,
               shift: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated residual ``x + gate * y`` and the next sublayer's adaLN norm of it, in one pass."""
    x = torch.addcmul(x, gate, y)
    return x, F.layer_norm(x, (x.shape[-1],), scale_plus_one, shift, eps)


@compiled_on_gpu
def norm_mish(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The conv block's LayerNorm then Mish."""
    return F.mish(F.layer_norm(x, (x.shape[-1],), weight, bias, eps))


@compiled_on_gpu
def qk_norm_kv(qk: torch.Tensor, v: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float,
               att_cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head LayerNorm of q and k (each its own affine) and this chunk's keys/values.

    qk (b, t, 2, heads, d), v (b, t, heads, d), norm weight/bias (2, 1, d); att_cache (b, heads,
    t_cache, 2d) newest first, or None. Returns q (b, heads, t, d), the keys/values to attend over
    [this chunk's, att_cache] (b, heads, t + t_cache, 2d), and its keys and its values (b, heads,
    t + t_cache, d), views: made in one pass (keys and values joined with the cache separately were two
    more kernels, each reading half of every cache row).
    """
    d = qk.shape[-1]
    qk = torch.addcmul(norm_bias, F.layer_norm(qk, (d,), eps=eps), norm_weight)
    q, k, v = qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2), v.transpose(1, 2)
    kv = torch.cat([k, v], dim=3)
    if att_cache is not None:
        kv = torch.cat([kv, att_cache], dim=2)
    return q, kv, kv[..., :d], kv[..., d:]


@compiled_on_gpu
def conv_frames(x: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """A causal conv's input windows as GEMM rows.

    x (b, t, c), tail (b, k-1, c): the previous inputs' last k-1 frames (zeros at the start). Returns
    (b, t, c*k), row j holding frames j .. j+k-1 of [tail, x] channel-major (the conv weight's
    (c_in, k) order). (The next tail is left to the caller: returned from here it cost a second kernel.)
    """
    k = tail.shape[1] + 1
    return torch.cat([tail, x], dim=1).unfold(1, k, 1).reshape(x.shape[0], x.shape[1], -1)


@compiled_on_gpu
def estimator_input(x: torch.Tensor, mu: torch.Tensor, spks: Optional[torch.Tensor],
                    cond: Optional[torch.Tensor]) -> torch.Tensor:
    """The estimator's input frames: [x, mu, spks, cond] on channels, made time-major.

    x, mu, cond (b, 80, t); spks (b, 80), repeated over time. Returns (b, t, 80 * parts), contiguous.
    """
    parts = [x, mu]
    if spks is not None:
        parts.append(spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    if cond is not None:
        parts.append(cond)
    return torch.cat(parts, dim=1).transpose(1, 2).contiguous()


@compiled_on_gpu
def guided_euler_step(x: torch.Tensor, velocity: torch.Tensor, dt: torch.Tensor, cfg_rate: float) -> torch.Tensor:
    """x + dt * ((1 + r) * v_cond - r * v_uncond): one Euler step with classifier-free guidance."""
    cond_v, uncond_v = velocity.chunk(2, dim=0)
    return x + dt * ((1.0 + cfg_rate) * cond_v - cfg_rate * uncond_v)
