"""Conformer token encoder of the flow: `UpsampleConformerEncoderV2`.

Speech tokens (25 Hz) become 50 Hz frame features: a linear input layer with ESPnet relative
positional encoding, a pre-lookahead convolution (sees `pre_lookahead_len` future tokens), a stack
of conformer blocks at 25 Hz, a x2 nearest upsample + conv, a second input layer and a second stack
of blocks at 50 Hz. Module and parameter names mirror the published checkpoint (``flow.pt`` keys under
``encoder.``) so it loads with ``strict=True``.

Two modes, as in the reference:
- ``forward``: whole sequence, full (bidirectional) attention; the lookahead of the last tokens is
  zero padding.
- ``forward_chunk``: streaming; the caller passes the new tokens *plus* the lookahead tokens, the
  lookahead part is consumed by the pre-lookahead conv and not emitted. Attention caches of the 25 Hz
  blocks are stored repeated x2 in time so both stacks share one tensor (reference layout).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@functools.lru_cache(maxsize=256)
def relative_position_encoding(size: int, d_model: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """ESPnet relative positional table for positions size-1 .. -(size-1): shape (1, 2*size-1, d_model).

    Computed on demand instead of a 5000-long table held per model; the values equal the reference's
    slice of its precomputed table because the same float32 products are evaluated. Cached per size
    (streaming repeats a few sizes; read-only for callers): the host-to-device copy of a fresh table
    costs a sync per call and cannot happen inside a CUDA-graph capture.
    """
    # A normal tensor even when first asked for under inference_mode: cached, it may be used outside it.
    with torch.inference_mode(False), torch.no_grad():
        positions = torch.arange(size - 1, -size, -1, dtype=torch.float32).unsqueeze(1)
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        table = torch.zeros(2 * size - 1, d_model)
        table[:, 0::2] = torch.sin(positions * inv_freq)
        table[:, 1::2] = torch.cos(positions * inv_freq)
        return table.unsqueeze(0).to(device=device, dtype=dtype)


class LinearInput(nn.Module):
    """Linear + LayerNorm input layer, then scales by sqrt(d) (the positional encoding's x-scale)."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        # indices 0/1 mirror the reference's Sequential(Linear, LayerNorm, Dropout)
        self.out = nn.Sequential(nn.Linear(input_size, output_size), nn.LayerNorm(output_size, eps=1e-5))
        self.x_scale = math.sqrt(output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.x_scale


class RelPositionMultiHeadedAttention(nn.Module):
    """Transformer-XL style self-attention with relative positions (ESPnet "rel_selfattn")."""

    def __init__(self, n_head: int, n_feat: int, key_bias: bool = True):
        super().__init__()
        if n_feat % n_head:
            raise ValueError(f"attention size {n_feat} is not divisible by {n_head} heads")
        self.h = n_head
        self.d_k = n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat, bias=key_bias)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_head, self.d_k))

    @staticmethod
    def rel_shift(scores: torch.Tensor) -> torch.Tensor:
        """The ESPnet shifting trick: (b, h, t1, 2*t2-1) -> (b, h, t1, t2).

        With a cache (t1 < t2) this is applied exactly as the reference does, which is what the
        checkpoint was run with.
        """
        b, h, t1, width = scores.shape
        padded = torch.cat([scores.new_zeros(b, h, t1, 1), scores], dim=-1)
        padded = padded.view(b, h, width + 1, t1)
        return padded[:, :, 1:].reshape(b, h, t1, width)[:, :, :, : width // 2 + 1]

    def forward(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        cache: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t1, d); pos_emb (1, 2*t2-1, d); mask (b, 1, t2) bool or None; cache (b, h, t_cache, 2*d_k).

        Returns the output and the new cache (old frames first, then these).
        """
        b, t1, _ = x.shape
        q = self.linear_q(x).view(b, t1, self.h, self.d_k)
        k = self.linear_k(x).view(b, t1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t1, self.h, self.d_k).transpose(1, 2)
        if cache is not None and cache.size(0) > 0:
            k_cache, v_cache = cache.split(self.d_k, dim=-1)
            k = torch.cat([k_cache, k], dim=2)
            v = torch.cat([v_cache, v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)

        p = self.linear_pos(pos_emb).view(pos_emb.size(0), -1, self.h, self.d_k).transpose(1, 2)
        q_u = (q + self.pos_bias_u).transpose(1, 2)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        content = torch.matmul(q_u, k.transpose(-2, -1))
        position = torch.matmul(q_v, p.transpose(-2, -1))
        if content.shape != position.shape:
            position = self.rel_shift(position)
        scores = (content + position) / math.sqrt(self.d_k)

        if mask is not None and mask.size(2) > 0:
            blocked = mask.unsqueeze(1).eq(0)[:, :, :, : scores.size(-1)]
            attn = torch.softmax(scores.masked_fill(blocked, -float("inf")), dim=-1).masked_fill(blocked, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t1, self.h * self.d_k)
        return self.linear_out(out), new_cache


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim: int, hidden_units: int, activation: nn.Module):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.activation = activation
        self.w_2 = nn.Linear(hidden_units, idim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.activation(self.w_1(x)))


class ConformerEncoderLayer(nn.Module):
    """Pre-norm block: self-attention then feed-forward (the published config has no conv/macaron)."""

    def __init__(self, size: int, self_attn: RelPositionMultiHeadedAttention, feed_forward: PositionwiseFeedForward):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        att_cache: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attended, new_cache = self.self_attn(self.norm_mha(x), pos_emb, mask, att_cache)
        x = x + attended
        x = x + self.feed_forward(self.norm_ff(x))
        return x, new_cache


class PreLookaheadLayer(nn.Module):
    """conv1 sees `pre_lookahead_len` future tokens, conv2 is causal (2 past); residual."""

    def __init__(self, channels: int, pre_lookahead_len: int = 1):
        super().__init__()
        self.channels = channels
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, t, c); the future of the last tokens is zero padding."""
        h = F.pad(x.transpose(1, 2), (0, self.pre_lookahead_len))
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (2, 0)))
        return h.transpose(1, 2) + x

    def forward_chunk(self, x: torch.Tensor, cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t + lookahead, c) -> (b, t, c); cache (b, c, 2) holds conv1 outputs for conv2."""
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)))
        if cache is None:
            cache = h.new_zeros(h.shape[0], h.shape[1], 2)
        h = torch.cat([cache, h], dim=2)
        # Taken after the concatenation: the reference slices h alone, which breaks on 1-token chunks
        # (a 1-frame cache); identical whenever a chunk has 2 or more tokens.
        new_cache = h[..., -2:]
        h = self.conv2(h)
        return h.transpose(1, 2) + x[:, : -self.pre_lookahead_len], new_cache


class Upsample1D(nn.Module):
    """Nearest x`scale_factor` repeat, then a causal conv of kernel 2*stride+1."""

    def __init__(self, channels: int, out_channels: int, stride: int = 2, scale_factor: Optional[float] = None):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels
        self.stride = stride
        self.scale_factor = float(stride if scale_factor is None else scale_factor)
        self.conv = nn.Conv1d(channels, out_channels, stride * 2 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, c, t) -> (b, c, t*stride)."""
        up = F.interpolate(x, scale_factor=self.scale_factor, mode="nearest")
        return self.conv(F.pad(up, (self.stride * 2, 0)))

    def forward_chunk(self, x: torch.Tensor, cache: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        up = F.interpolate(x, scale_factor=self.scale_factor, mode="nearest")
        if cache is None:
            cache = x.new_zeros(x.shape[0], x.shape[1], self.stride * 2)
        up = torch.cat([cache, up], dim=2)
        return self.conv(up), up[..., -self.stride * 2 :]


_ACTIVATIONS = {"swish": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class UpsampleConformerEncoderV2(nn.Module):
    """See the module docstring. Dropout arguments are accepted (config compatibility) and unused:
    this is an inference-only implementation."""

    def __init__(
        self,
        input_size: int,
        output_size: int = 256,
        input_layer: str = "linear",
        pre_lookahead_len: int = 3,
        num_blocks: int = 6,
        num_up_blocks: int = 4,
        up_stride: int = 2,
        up_scale_factor: float = 2,
        attention_heads: int = 4,
        pos_enc_layer_type: str = "rel_pos_espnet",
        selfattention_layer_type: str = "rel_selfattn",
        key_bias: bool = True,
        linear_units: int = 2048,
        dropout_rate: float = 0.1,
        positional_dropout_rate: float = 0.1,
        attention_dropout_rate: float = 0.0,
        normalize_before: bool = True,
        activation_type: str = "swish",
        **_unused: object,
    ):
        super().__init__()
        if input_layer != "linear" or pos_enc_layer_type != "rel_pos_espnet" or selfattention_layer_type != "rel_selfattn":
            raise ValueError(
                "only input_layer=linear, pos_enc_layer_type=rel_pos_espnet, selfattention_layer_type=rel_selfattn"
                " are implemented (the published configuration)"
            )
        if not normalize_before:
            raise ValueError("only normalize_before=true is implemented (the published configuration)")
        self._output_size = output_size
        self.embed = LinearInput(input_size, output_size)
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)
        self.pre_lookahead_layer = PreLookaheadLayer(output_size, pre_lookahead_len)

        def block() -> ConformerEncoderLayer:
            return ConformerEncoderLayer(
                output_size,
                RelPositionMultiHeadedAttention(attention_heads, output_size, key_bias),
                PositionwiseFeedForward(output_size, linear_units, _ACTIVATIONS[activation_type]()),
            )

        self.encoders = nn.ModuleList([block() for _ in range(num_blocks)])
        self.up_layer = Upsample1D(output_size, output_size, stride=up_stride, scale_factor=up_scale_factor)
        self.up_embed = LinearInput(input_size, output_size)
        self.up_encoders = nn.ModuleList([block() for _ in range(num_up_blocks)])

    def output_size(self) -> int:
        return self._output_size

    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole utterance: xs (b, t, input_size) -> (b, t*stride, output_size), masks (b, 1, t*stride)."""
        masks = _valid_mask(xs_lens, xs.size(1))
        xs = self.embed(xs)
        pos_emb = relative_position_encoding(xs.size(1), self._output_size, xs.dtype, xs.device)
        xs = self.pre_lookahead_layer(xs)
        for layer in self.encoders:
            xs, _ = layer(xs, pos_emb, masks)
        xs = self.up_layer(xs.transpose(1, 2)).transpose(1, 2)
        xs_lens = xs_lens * self.up_layer.stride
        masks = _valid_mask(xs_lens, xs.size(1))
        xs = self.up_embed(xs)
        pos_emb = relative_position_encoding(xs.size(1), self._output_size, xs.dtype, xs.device)
        for layer in self.up_encoders:
            xs, _ = layer(xs, pos_emb, masks)
        return self.after_norm(xs), masks

    def forward_chunk(
        self,
        xs: torch.Tensor,
        last_chunk: bool = False,
        cnn_cache: Optional[torch.Tensor] = None,
        att_cache: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Streaming step.

        xs (b, t + lookahead, input_size); on the last chunk the lookahead is zero padding instead.
        cnn_cache (b, c, 2 + 2*stride); att_cache (num_blocks + num_up_blocks, b, h, 2*t1, 2*d_k)
        where the 25 Hz part is stored repeated x2 and only its first half is read (reference layout).
        Returns (b, t*stride, c) and the new caches.
        """
        n_low = len(self.encoders)
        offset = att_cache.shape[3] // 2 if att_cache is not None else 0
        low_caches = [att_cache[i, :, :, :offset] for i in range(n_low)] if att_cache is not None else [None] * n_low
        high_caches = (
            [att_cache[n_low + i] for i in range(len(self.up_encoders))]
            if att_cache is not None
            else [None] * len(self.up_encoders)
        )
        lookahead_cache = cnn_cache[:, :, :2] if cnn_cache is not None else None
        upsample_cache = cnn_cache[:, :, 2:] if cnn_cache is not None else None

        xs = self.embed(xs)
        if last_chunk:
            xs = F.pad(xs, (0, 0, 0, self.pre_lookahead_layer.pre_lookahead_len))
        xs, new_lookahead_cache = self.pre_lookahead_layer.forward_chunk(xs, lookahead_cache)

        pos_emb = relative_position_encoding(offset + xs.shape[1], self._output_size, xs.dtype, xs.device)
        new_low = []
        for layer, cache in zip(self.encoders, low_caches):
            xs, new_cache = layer(xs, pos_emb, None, cache)
            new_low.append(new_cache)

        xs, new_upsample_cache = self.up_layer.forward_chunk(xs.transpose(1, 2), upsample_cache)
        xs = self.up_embed(xs.transpose(1, 2))

        pos_emb = relative_position_encoding(
            offset * self.up_layer.stride + xs.shape[1], self._output_size, xs.dtype, xs.device
        )
        new_high = []
        for layer, cache in zip(self.up_encoders, high_caches):
            xs, new_cache = layer(xs, pos_emb, None, cache)
            new_high.append(new_cache)
        xs = self.after_norm(xs)

        new_att_cache = torch.cat([torch.stack(new_low).repeat(1, 1, 1, 2, 1), torch.stack(new_high)], dim=0)
        new_cnn_cache = torch.cat([new_lookahead_cache, new_upsample_cache], dim=2)
        return xs, new_cnn_cache, new_att_cache


def _valid_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """(b, 1, max_len) bool, True where the frame is inside the sequence."""
    positions = torch.arange(max_len, device=lengths.device)
    return (positions.unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(1)
