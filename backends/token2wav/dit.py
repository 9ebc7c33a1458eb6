"""DiT estimator of the flow-matching decoder (Step-Audio2 "DiT-v5": DiT blocks with a causal conv).

Input per frame: noisy mel x, encoder output mu, speaker embedding and condition mel, stacked on the
channel axis (80*4 = 320 channels), projected to `hidden_size`. Each block does adaLN-zero modulated
self-attention (QK-LayerNorm), a causal conv block and an MLP, all gated by the timestep embedding.
Parameter names mirror the published checkpoint (``decoder.estimator.*``).

Streaming (``forward_chunk``): attention over [this chunk, cached frames] (chunk-causal across chunks,
bidirectional inside a chunk; a key mask only hides padding when streams share a batch); each block's
KV cache is stored **newest frames first** exactly as the reference does, which matters for how caches
get truncated later.

How it computes (same function as the reference, fewer kernels; see ``fused``): the adaLN modulation
depends only on the timestep, so ``modulation(t)`` computes every block's at once and the scale and
shift become the layer norms' affine; each gated residual is fused with the next sublayer's norm, so a
block hands its MLP output and gate (``Pending``) to the next block, and the last to the final layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from backends.token2wav import fused


MODULATION_ROWS = 9
"""adaLN outputs per block, in the checkpoint's order: shift, scale, gate for attention, MLP and conv."""
SHIFT_MSA, SCALE_MSA, GATE_MSA, SHIFT_MLP, SCALE_MLP, GATE_MLP, SHIFT_CONV, SCALE_CONV, GATE_CONV = range(9)

Pending = Optional[tuple[torch.Tensor, torch.Tensor]]
"""A residual branch not yet added: (output, gate); added by the next block's (or the final layer's) norm."""


def enter_norm(x: torch.Tensor, pending: Pending, scale_plus_one: torch.Tensor, shift: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the pending gated residual to x (if any) and take the adaLN norm of the sum."""
    if pending is None:
        return x, fused.modulated_norm(x, scale_plus_one, shift, eps)
    return fused.gated_norm(x, pending[0], pending[1], scale_plus_one, shift, eps)


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fc1 and its activation, tanh-approximated GELU, in one GEMM (cuBLASLt's GELU epilogue on a GPU; addmm + gelu elsewhere).
        rows = x.reshape(-1, x.shape[-1])
        hidden = torch._addmm_activation(self.fc1.bias, rows, self.fc1.weight.t(), use_gelu=True)
        return self.fc2(hidden).reshape(*x.shape[:-1], -1)


class Attention(nn.Module):
    """Multi-head self-attention with LayerNorm on q and k (per head).

    q, k and v come from one GEMM (weights concatenated; kept by ``fuse_projections``, which
    ``CausalConditionalCFM.freeze`` calls, or stacked per call); q and k are normalised together
    (``fused.qk_norm_kv``). Why one GEMM: with one stream a solve is bound by its kernel count (~2 500 in
    a 16-block, 10-step solve, measured on an H100), and the split projections were one kernel more per
    block and step.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, dim)
        # Derived from the parameters by fuse_projections (not saved: the checkpoint has no such keys).
        for name in ("qkv_weight", "qkv_bias", "qk_norm_weight", "qk_norm_bias"):
            self.register_buffer(name, None, persistent=False)

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q/k/v projection weight and bias, concatenated; q/k norm weight and bias, (2, 1, head_dim)."""
        return (torch.cat([self.to_q.weight, self.to_k.weight, self.to_v.weight]),
                torch.cat([self.to_q.bias, self.to_k.bias, self.to_v.bias]),
                torch.stack([self.q_norm.weight, self.k_norm.weight]).unsqueeze(1),
                torch.stack([self.q_norm.bias, self.k_norm.bias]).unsqueeze(1))

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Keep the stacked q/k/v weights (``_stacked``) instead of stacking them per call. Call again if
        the weights change."""
        self.qkv_weight, self.qkv_bias, self.qk_norm_weight, self.qk_norm_bias = (
            t.detach().clone() for t in self._stacked())

    def forward_chunk(self, x: torch.Tensor, att_cache: Optional[torch.Tensor],
                      key_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, c); att_cache (b, h, t_cache, 2*head_dim) newest-first, or None.

        ``key_bias`` (b, 1, 1, t + t_cache): an additive bias, -inf for keys that take no part
        (``key_bias_for``). It lets streams whose caches differ in length share one batch (each cache
        padded to a common length). The DiT has no positional encoding, so where the padding sits does
        not matter, only that it is masked.

        Returns the output (b, t, c) and the keys/values it attended over, this chunk's then the
        cache's (b, h, t + t_cache, 2*head_dim): the new cache, newest first (this chunk's own are its
        first t frames).
        """
        b, t, _ = x.shape
        fused_weights = self.qkv_weight is not None
        qkv_weight, qkv_bias, norm_weight, norm_bias = (
            (self.qkv_weight, self.qkv_bias, self.qk_norm_weight, self.qk_norm_bias) if fused_weights else self._stacked())
        qkv = F.linear(x, qkv_weight, qkv_bias).view(b, t, 3, self.num_heads, self.head_dim)
        qk, v = qkv[:, :, :2], qkv[:, :, 2]
        # q_norm and k_norm share eps (LayerNorm's default); their affines differ.
        q, kv, k, v = fused.qk_norm_kv(qk, v, norm_weight, norm_bias, self.q_norm.eps, att_cache)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias)
        return self.proj(attended.transpose(1, 2).reshape(b, t, -1)), kv


class TimestepEmbedder(nn.Module):
    """Sinusoidal embedding of t*1000 followed by a 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.frequency_embedding_size = frequency_embedding_size
        self.scale = 1000

    @staticmethod
    def sinusoid(t: torch.Tensor, dim: int, max_period: float = 10000) -> torch.Tensor:
        half = dim // 2
        # Made on t's device: a host-to-device copy here would break CUDA-graph capture of the solve.
        positions = torch.arange(start=0, end=half, dtype=torch.float32, device=t.device)
        freqs = torch.exp(-math.log(max_period) * positions / half).to(t.dtype)
        args = t[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.sinusoid(t * self.scale, self.frequency_embedding_size))


class CausalConvBlock(nn.Module):
    """conv -> LayerNorm -> Mish -> conv, on (b, t, c); both convs causal (kernel 3, left context 2).

    The Sequential only mirrors the checkpoint's parameter names (block.1 and block.6 are the convs,
    block.3 the LayerNorm); the computation is ``forward_chunk``. Each conv runs as one GEMM over the
    shifted frames (``fused.conv_frames``). Why not F.conv1d: on a GPU cuDNN plans every conv1d call on
    the CPU (~0.5 ms measured on an H100 host), and time-major frames spare the transposes a
    channel-major conv needs around the block's layer norms.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.context = kernel_size - 1
        self.block = nn.Sequential(
            nn.Identity(),
            nn.Conv1d(in_channels, out_channels, kernel_size),
            nn.Identity(),
            nn.LayerNorm(out_channels),
            nn.Mish(),
            nn.Identity(),
            nn.Conv1d(out_channels, out_channels, kernel_size),
        )

    @staticmethod
    def _conv(frames: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
        return F.linear(frames, conv.weight.reshape(conv.out_channels, -1), conv.bias)

    def forward_chunk(self, x: torch.Tensor, cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, ConvTails]:
        """cache (b, in+out, kernel-1): the two convs' input tails, concatenated on channels (None: zeros).

        Returns the output and the new tails, unjoined (``ConvTails``; ``conv_cache`` joins them).
        """
        if cache is None:
            cache = x.new_zeros(x.shape[0], self.in_channels + self.out_channels, self.context)
        tail1, tail2 = cache.transpose(1, 2).split((self.in_channels, self.out_channels), dim=2)
        norm = self.block[3]
        h = fused.norm_mish(self._conv(fused.conv_frames(x, tail1), self.block[1]), norm.weight, norm.bias, norm.eps)
        return self._conv(fused.conv_frames(h, tail2), self.block[6]), (_last_frames(x, tail1), _last_frames(h, tail2))


ConvTails = tuple[torch.Tensor, torch.Tensor]
"""A conv block's new input tails (b, kernel-1, in) and (b, kernel-1, out), time-major; often views of
its inputs."""


def _last_frames(x: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The last ``tail.shape[1]`` frames of [tail, x]: the next chunk's tail (a view of x when x is long
    enough, as every chunk is: a GPU kernel less per conv than returning it from ``conv_frames``)."""
    context = tail.shape[1]
    if x.shape[1] >= context:
        return x[:, x.shape[1] - context:]
    return torch.cat([tail, x], dim=1)[:, -context:]


def conv_cache(tails: list[ConvTails]) -> torch.Tensor:
    """The blocks' tails as one conv cache (blocks, b, in+out, kernel-1), in three copies for all blocks
    (joined per block, they were one copy per block and then another for the stack)."""
    firsts, seconds = torch.stack([t[0] for t in tails]), torch.stack([t[1] for t in tails])
    return torch.cat([firsts, seconds], dim=3).transpose(2, 3)


class DiTBlock(nn.Module):
    """Attention, causal conv block and MLP, each adaLN-modulated and gated by the timestep.

    The modulation (``adaLN_modulation(c)``) is computed once per timestep for all blocks by
    ``DiT.modulation`` and passed in as ``mod`` (9, hidden): see ``MODULATION_ROWS``. A block takes the
    previous block's unadded MLP branch (``Pending``) and returns its own.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads, head_dim)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(hidden_size, int(hidden_size * mlp_ratio))
        self.norm3 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.conv = CausalConvBlock(hidden_size, hidden_size, kernel_size=3)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, MODULATION_ROWS * hidden_size))

    def forward_chunk(
        self, x: torch.Tensor, pending: Pending, mod: torch.Tensor, cnn_cache: Optional[torch.Tensor],
        att_cache: Optional[torch.Tensor], key_bias: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Pending, ConvTails, torch.Tensor]:
        """Returns x, this block's pending MLP branch, its conv tails and its new attention cache
        (``Attention.forward_chunk``)."""
        x, h = enter_norm(x, pending, mod[SCALE_MSA], mod[SHIFT_MSA], self.norm1.eps)
        attended, new_att = self.attn.forward_chunk(h, att_cache, key_bias)
        x, h = fused.gated_norm(x, attended, mod[GATE_MSA], mod[SCALE_CONV], mod[SHIFT_CONV], self.norm3.eps)
        convolved, new_cnn = self.conv.forward_chunk(h, cnn_cache)
        x, h = fused.gated_norm(x, convolved, mod[GATE_CONV], mod[SCALE_MLP], mod[SHIFT_MLP], self.norm2.eps)
        return x, (self.mlp(h), mod[GATE_MLP]), new_cnn, new_att


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels)

    def forward(self, x: torch.Tensor, pending: Pending, mod: torch.Tensor) -> torch.Tensor:
        """mod (2, hidden): [shift, 1 + scale] (``DiT.modulation``)."""
        return self.linear(enter_norm(x, pending, mod[1], mod[0], self.norm_final.eps)[1])


def key_bias_for(key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool key mask (b, t_keys) as the additive attention bias (b, 1, 1, t_keys): 0 or -inf.

    Made once per solve: a bool mask would be converted again in every block of every step. Its rows
    are allocated 16-aligned (then sliced to t_keys): PyTorch's fused attention pads a bias whose row
    stride is not a multiple of 16 before each call.
    """
    batch, keys = key_mask.shape
    aligned = -(-keys // 16) * 16
    bias = torch.zeros(batch, aligned, dtype=dtype, device=key_mask.device)[:, :keys]
    return bias.masked_fill_(~key_mask, float("-inf"))[:, None, None, :]


@dataclass(frozen=True)
class StepModulation:
    """The adaLN outputs of one timestep: every row of a solve shares them (one t per Euler step).

    blocks (depth, 9, hidden) in the checkpoint's order (``MODULATION_ROWS``), final (2, hidden); the
    scale rows already hold 1 + scale.
    """

    blocks: torch.Tensor
    final: torch.Tensor


class DiT(nn.Module):
    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        mlp_ratio: float = 4.0,
        depth: int = 28,
        num_heads: int = 8,
        head_dim: int = 64,
        hidden_size: int = 256,
    ):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.in_proj = nn.Linear(in_channels, hidden_size)
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, head_dim, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, out_channels)

    def modulation(self, t: torch.Tensor) -> StepModulation:
        """The adaLN outputs of every block for timestep ``t`` (a 1-element tensor)."""
        c = F.silu(self.t_embedder(t.reshape(1)))                          # (1, hidden); each adaLN starts with SiLU
        blocks = torch.stack([block.adaLN_modulation[1](c) for block in self.blocks])
        blocks = blocks.view(len(self.blocks), MODULATION_ROWS, self.hidden_size)
        blocks[:, [SCALE_MSA, SCALE_MLP, SCALE_CONV]] += 1
        final = self.final_layer.adaLN_modulation[1](c).view(2, self.hidden_size)
        final[1] += 1
        return StepModulation(blocks, final)

    def forward(self, x, key_bias, mu, mod: StepModulation, spks=None, cond=None) -> torch.Tensor:
        """Whole sequence. x, mu, cond (b, c, t); key_bias: ``key_bias_for`` the (b, t) frame mask;
        mod: ``modulation(t)``; spks (b, c). Returns (b, out, t)."""
        return self.forward_chunk(x, mu, mod, spks, cond, key_bias=key_bias)[0]

    def forward_chunk(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        mod: StepModulation,
        spks: Optional[torch.Tensor],
        cond: Optional[torch.Tensor],
        cnn_cache: Optional[torch.Tensor] = None,
        att_cache: Optional[torch.Tensor] = None,
        key_bias: Optional[torch.Tensor] = None,
        new_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk. mod: ``modulation(t)``; cnn_cache (depth, b, 2*hidden, 2); att_cache (depth, b,
        heads, t_cache, 2*head_dim).

        ``key_bias``: ``key_bias_for`` the (b, t + t_cache) mask of which frames of [this chunk, the cache]
        are real keys (padding is ignored); lets streams with different chunk and cache lengths share a
        batch. Made once per solve by the caller.
        ``new_only``: return only this chunk's frames of the attention cache (the caller prepends them
        to its old cache); a CUDA graph then keeps a static output of the chunk's size, not the cache's.

        Returns the output (b, out, t) and freshly allocated caches (never views of shared buffers).
        """
        h = self.in_proj(fused.estimator_input(x, mu, spks, cond))
        pending: Pending = None
        new_cnn: list[ConvTails] = []
        new_att = []
        for i, block in enumerate(self.blocks):
            h, pending, block_cnn, block_att = block.forward_chunk(
                h, pending, mod.blocks[i],
                cnn_cache[i] if cnn_cache is not None else None,
                att_cache[i] if att_cache is not None else None,
                key_bias,
            )
            new_cnn.append(block_cnn)
            new_att.append(block_att[:, :, :x.shape[2]] if new_only else block_att)
        return self.final_layer(h, pending, mod.final).transpose(1, 2), conv_cache(new_cnn), torch.stack(new_att)

    def fuse_projections(self) -> None:
        """Precompute the stacked q/k/v weights of every block (``Attention.fuse_projections``)."""
        for block in self.blocks:
            block.attn.fuse_projections()
