"""DiT estimator of the flow-matching decoder (Step-Audio2 "DiT-v5": DiT blocks with a causal conv).

Input per frame: noisy mel x, encoder output mu, speaker embedding and condition mel, stacked on the
channel axis (80*4 = 320 channels), projected to `hidden_size`. Each block does adaLN-zero modulated
self-attention (QK-LayerNorm), a causal conv block and an MLP, all gated by the timestep embedding.
Parameter names mirror the published checkpoint (``decoder.estimator.*``).

Streaming (``forward_chunk``): attention over [this chunk, cached frames] with no mask (chunk-causal
across chunks, bidirectional inside a chunk); each block's KV cache is stored **newest frames first**
exactly as the reference does, which matters for how caches get truncated later.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with LayerNorm on q and k (per head)."""

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

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q_norm(self._heads(self.to_q(x)))
        k = self.k_norm(self._heads(self.to_k(x)))
        return q, k, self._heads(self.to_v(x))

    def _out(self, attended: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attended.shape
        return self.proj(attended.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """x (b, t, c); attn_mask (b, 1, t) bool (key padding)."""
        q, k, v = self._qkv(x)
        return self._out(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.unsqueeze(1)))

    def forward_chunk(self, x: torch.Tensor, att_cache: Optional[torch.Tensor],
                      key_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, c); att_cache (b, h, t_cache, 2*head_dim) newest-first.

        ``key_mask`` (b, 1, 1, t + t_cache): an additive bias, -inf for keys that take no part. It lets
        streams whose caches differ in length share one batch (each cache padded to a common length).
        The DiT has no positional encoding, so where the padding sits does not matter, only that it
        is masked.

        Returns the output and this chunk's own keys/values (b, h, t, 2*head_dim); the new cache is
        ``cat([that, att_cache], dim=2)`` (newest first), left to the caller.
        """
        q, k, v = self._qkv(x)
        new_kv = torch.cat([k, v], dim=3)
        if att_cache is not None:
            k_cache, v_cache = att_cache.chunk(2, dim=3)
            k = torch.cat([k, k_cache], dim=2)
            v = torch.cat([v, v_cache], dim=2)
        return self._out(F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)), new_kv


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


class Transpose(nn.Module):
    def __init__(self, dim0: int, dim1: int):
        super().__init__()
        self.dim0, self.dim1 = dim0, dim1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(self.dim0, self.dim1)


def conv1d_as_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Unpadded conv1d (stride 1) as one matrix product over the k shifted views of x.

    x (b, c_in, t + k - 1), weight (c_out, c_in, k) -> (b, c_out, t), the same function as F.conv1d.
    Why: on a GPU cuDNN plans every conv1d call on the CPU (~0.5 ms measured on an H100 host), and a
    streaming chunk runs 10 steps x 16 blocks x 2 convs; an unfold + GEMM costs two launches.
    """
    k = weight.shape[2]
    windows = x.unfold(2, k, 1)                       # (b, c_in, t, k), a view
    cols = windows.permute(0, 2, 1, 3).reshape(x.shape[0], windows.shape[2], -1)   # (b, t, c_in*k)
    return F.linear(cols, weight.reshape(weight.shape[0], -1), bias).transpose(1, 2)


class CausalConv1d(nn.Conv1d):
    """Conv1d that only looks back (left zero padding or a cache of the last kernel-1 inputs)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.context = kernel_size - 1

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return conv1d_as_matmul(x, self.weight, self.bias)
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv(F.pad(x, (self.context, 0)))

    def forward_chunk(self, x: torch.Tensor, cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if cache is None:
            cache = x.new_zeros(x.shape[0], self.in_channels, self.context)
        x = torch.cat([cache, x], dim=2)
        return self._conv(x), x[..., -self.context :]


class CausalConvBlock(nn.Module):
    """conv -> LayerNorm -> Mish -> conv, on (b, t, c). Sequential indices mirror the checkpoint
    (block.1 and block.6 are the convs, block.3 the LayerNorm)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3):
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.block = nn.Sequential(
            Transpose(1, 2),
            CausalConv1d(in_channels, out_channels, kernel_size),
            Transpose(1, 2),
            nn.LayerNorm(out_channels),
            nn.Mish(),
            Transpose(1, 2),
            CausalConv1d(out_channels, out_channels, kernel_size),
            Transpose(1, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)

    def forward_chunk(self, x: torch.Tensor, cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """cache (b, in+out, kernel-1): the two convs' input tails, concatenated on channels."""
        cache1, cache2 = cache.split((self.in_channels, self.out_channels), dim=1) if cache is not None else (None, None)
        h, new1 = self.block[1].forward_chunk(x.transpose(1, 2), cache1)
        h = self.block[4](self.block[3](h.transpose(1, 2)))
        h, new2 = self.block[6].forward_chunk(h.transpose(1, 2), cache2)
        return h.transpose(1, 2), torch.cat([new1, new2], dim=1)


class DiTBlock(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads, head_dim)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(hidden_size, int(hidden_size * mlp_ratio))
        self.norm3 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.conv = CausalConvBlock(hidden_size, hidden_size, kernel_size=3)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 9 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = self.adaLN_modulation(c).chunk(9, dim=-1)
        x = x + gate_msa * self.attn(modulate(self.norm1(x), shift_msa, scale_msa), attn_mask)
        x = x + gate_conv * self.conv(modulate(self.norm3(x), shift_conv, scale_conv))
        return x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))

    def forward_chunk(
        self, x: torch.Tensor, c: torch.Tensor, cnn_cache: Optional[torch.Tensor], att_cache: Optional[torch.Tensor],
        key_mask: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = self.adaLN_modulation(c).chunk(9, dim=-1)
        attended, new_att = self.attn.forward_chunk(modulate(self.norm1(x), shift_msa, scale_msa), att_cache, key_mask)
        x = x + gate_msa * attended
        convolved, new_cnn = self.conv.forward_chunk(modulate(self.norm3(x), shift_conv, scale_conv), cnn_cache)
        x = x + gate_conv * convolved
        x = x + gate_mlp * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x, new_cnn, new_att


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


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

    def _inputs(self, x, mu, t, spks, cond) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack [x, mu, spks, cond] on channels -> (b, t, hidden); timestep embedding (b, 1, hidden)."""
        c = self.t_embedder(t).unsqueeze(1)
        parts = [x, mu]
        if spks is not None:
            parts.append(spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        if cond is not None:
            parts.append(cond)
        return self.in_proj(torch.cat(parts, dim=1).transpose(1, 2)), c

    def forward(self, x, mask, mu, t, spks=None, cond=None) -> torch.Tensor:
        """Whole sequence. x, mu, cond (b, c, t); mask (b, 1, t); t (b,); spks (b, c). Returns (b, out, t)."""
        h, c = self._inputs(x, mu, t, spks, cond)
        attn_mask = mask.bool()
        for block in self.blocks:
            h = block(h, c, attn_mask)
        return self.final_layer(h, c).transpose(1, 2)

    def forward_chunk(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: Optional[torch.Tensor],
        cond: Optional[torch.Tensor],
        cnn_cache: Optional[torch.Tensor] = None,
        att_cache: Optional[torch.Tensor] = None,
        key_mask: Optional[torch.Tensor] = None,
        new_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk. cnn_cache (depth, b, 2*hidden, 2); att_cache (depth, b, heads, t_cache, 2*head_dim).

        ``key_mask`` (b, t + t_cache) bool: which frames of [this chunk, the cache] are real keys (False:
        padding, ignored); lets streams with different chunk and cache lengths share a batch.
        ``new_only``: return only this chunk's frames of the attention cache (the caller prepends them
        to its old cache); a CUDA graph then keeps a static output of the chunk's size, not the cache's.

        Returns the output (b, out, t) and freshly allocated caches (never views of shared buffers).
        """
        h, c = self._inputs(x, mu, t, spks, cond)
        key_bias = None
        if key_mask is not None:
            # As an additive bias, made once: a bool mask would be converted in each of the blocks.
            key_bias = torch.zeros(key_mask.shape, dtype=h.dtype, device=h.device).masked_fill(~key_mask, float("-inf"))
            key_bias = key_bias[:, None, None, :]
        new_cnn, new_att = [], []
        for i, block in enumerate(self.blocks):
            h, block_cnn, block_att = block.forward_chunk(
                h, c,
                cnn_cache[i] if cnn_cache is not None else None,
                att_cache[i] if att_cache is not None else None,
                key_bias,
            )
            new_cnn.append(block_cnn)
            if att_cache is not None and not new_only:
                block_att = torch.cat([block_att, att_cache[i]], dim=2)
            new_att.append(block_att)
        return self.final_layer(h, c).transpose(1, 2), torch.stack(new_cnn), torch.stack(new_att)
