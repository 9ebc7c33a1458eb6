"""Conditional flow matching decoder: Euler ODE solve with classifier-free guidance.

The reference draws its starting noise from a 10-minute random buffer made at construction and
indexes it by the estimator cache length. Here the caller always passes the starting noise ``z``
(shape (b, 80, t)): the engine draws it from a per-stream generator, parity tests pass the
reference's noise. So nothing random or mutable lives in the module and streams cannot interact.

cond and uncond run as one batch of 2B (CFG): the uncond half gets zero mu / speaker / condition.
The streaming caches are stacked per Euler step: cnn (steps, depth, 2B, 2*hidden, 2) and
att (steps, depth, 2B, heads, t, 2*head_dim).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from backends.token2wav import fused
from backends.token2wav.dit import DiT, StepModulation, key_bias_for


def cosine_t_span(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t_i = 1 - cos(pi/2 * i/n): small steps near the noise end."""
    t_span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t_span * 0.5 * torch.pi)


def euler_steps(n_timesteps: int, device: torch.device, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(t, dt) of each Euler step, accumulated as the reference does (t += dt, in the model's dtype)."""
    t_span = cosine_t_span(n_timesteps, device, dtype)
    t, dt = t_span[0].unsqueeze(0), t_span[1] - t_span[0]
    steps = []
    for step in range(1, len(t_span)):
        steps.append((t, dt))
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return steps


class CausalConditionalCFM(nn.Module):
    def __init__(self, estimator: DiT, inference_cfg_rate: float = 0.7, **_unused: object):
        super().__init__()
        if inference_cfg_rate <= 0:
            raise ValueError("inference_cfg_rate must be > 0 (the solver always batches cond + uncond)")
        self.estimator = estimator
        self.inference_cfg_rate = inference_cfg_rate
        self.out_channels = estimator.out_channels
        # Set by freeze(): ((n_timesteps, device, dtype), per-step (modulation, dt)).
        self._frozen: Optional[tuple[tuple, list[tuple[StepModulation, torch.Tensor]]]] = None

    @torch.inference_mode()
    def freeze(self, n_timesteps: int) -> None:
        """Precompute what depends only on the weights and the step count, for the solves to come.

        Each step's timestep modulation (``DiT.modulation``: the timestep MLP and 17 adaLN layers) and
        the stacked q/k/v projections. Why: they are the same for every chunk, and computing them in each
        solve costs ~40 kernel launches per Euler step. Call after moving the module to its device and
        dtype and after loading weights, and again if either changes.
        """
        device, dtype = self.estimator.in_proj.weight.device, self.estimator.in_proj.weight.dtype
        self.estimator.fuse_projections()
        self._frozen = (n_timesteps, device, dtype), self._compute_steps(n_timesteps, device, dtype)

    def _compute_steps(self, n_timesteps: int, device: torch.device,
                       dtype: torch.dtype) -> list[tuple[StepModulation, torch.Tensor]]:
        return [(self.estimator.modulation(t), dt) for t, dt in euler_steps(n_timesteps, device, dtype)]

    def _steps(self, n_timesteps: int, device: torch.device, dtype: torch.dtype) -> list[tuple[StepModulation, torch.Tensor]]:
        if self._frozen is not None and self._frozen[0] == (n_timesteps, device, dtype):
            return self._frozen[1]
        return self._compute_steps(n_timesteps, device, dtype)

    @torch.inference_mode()
    def forward(
        self,
        mu: torch.Tensor,
        mask: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        z: torch.Tensor,
        n_timesteps: int = 10,
    ) -> torch.Tensor:
        """Whole utterance. mu, cond, z (b, 80, t); mask (b, 1, t); spks (b, 80). Returns mel (b, 80, t)."""
        x = z.to(mu.dtype)
        key_bias = key_bias_for(torch.cat([mask, mask], dim=0)[:, 0].bool(), mu.dtype)   # once, not per step
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)
        spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)
        for mod, dt in self._steps(n_timesteps, mu.device, mu.dtype):
            velocity = self.estimator(torch.cat([x, x], dim=0), key_bias, mu_in, mod, spks_in, cond_in)
            x = fused.guided_euler_step(x, velocity, dt, self.inference_cfg_rate)
        return x

    @torch.inference_mode()
    def forward_chunk(
        self,
        mu: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        z: torch.Tensor,
        n_timesteps: int = 10,
        cnn_cache: Optional[torch.Tensor] = None,
        att_cache: Optional[torch.Tensor] = None,
        key_mask: Optional[torch.Tensor] = None,
        new_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One streaming chunk. Returns mel (b, 80, t) and the new per-step caches.

        ``key_mask`` (2b, t + t_cache) bool: the real frames of a padded chunk and cache (DiT.forward_chunk).
        ``new_only``: the attention caches returned hold only this chunk's frames (see DiT.forward_chunk).
        """
        x = z.to(mu.dtype)
        mu_in = torch.cat([mu, torch.zeros_like(mu)], dim=0)
        spks_in = torch.cat([spks, torch.zeros_like(spks)], dim=0)
        cond_in = torch.cat([cond, torch.zeros_like(cond)], dim=0)
        key_bias = key_bias_for(key_mask, mu.dtype) if key_mask is not None else None
        new_cnn, new_att = [], []
        for step, (mod, dt) in enumerate(self._steps(n_timesteps, mu.device, mu.dtype)):
            velocity, step_cnn, step_att = self.estimator.forward_chunk(
                x.repeat(2, 1, 1), mu_in, mod, spks_in, cond_in,
                cnn_cache[step] if cnn_cache is not None else None,
                att_cache[step] if att_cache is not None else None,
                key_bias, new_only=new_only,
            )
            new_cnn.append(step_cnn)
            new_att.append(step_att)
            x = fused.guided_euler_step(x, velocity, dt, self.inference_cfg_rate)
        return x, torch.stack(new_cnn), torch.stack(new_att)
