"""The token-to-mel flow, `CausalMaskedDiffWithXvec`: tokens -> conformer encoder -> flow matching.

Parameter names mirror the published ``flow.pt`` (input_embedding, spk_embed_affine_layer, encoder,
encoder_proj, decoder.estimator) so it loads with ``strict=True``. Batch size 1 per call (a stream);
the CFG doubling to 2 happens inside the decoder.

Noise: every method takes a ``noise`` callable ``(offset, n_frames) -> Tensor (1, 80, n_frames)``.
``offset`` is the estimator cache length before the call, the index the reference uses into its
fixed noise buffer, so parity tests can replay the reference exactly; the engine ignores it and
draws per-stream noise by absolute frame position instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backends.token2wav.encoder import UpsampleConformerEncoderV2
from backends.token2wav.flow_matching import CausalConditionalCFM

NoiseFn = Callable[[int, int], torch.Tensor]


@dataclass
class FlowCache:
    """Per-stream streaming caches (each tensor owned by one stream; never a view of a shared buffer).

    conformer_cnn: (1, C, 2 + 2*up_stride); conformer_att: (blocks + up_blocks, 1, heads, T, 2*d_k)
    estimator_cnn: (steps, depth, 2, 2*hidden, 2); estimator_att: (steps, depth, 2, heads, T, 2*head_dim)
    """

    conformer_cnn: torch.Tensor
    conformer_att: torch.Tensor
    estimator_cnn: torch.Tensor
    estimator_att: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.conformer_cnn, self.conformer_att, self.estimator_cnn, self.estimator_att))

    def truncated(self, prompt_frames: int, recent_frames: int = 100) -> "FlowCache":
        """Bound the attention caches as the reference wrapper does after every chunk (``keep_prompt_and_recent``).

        Note the layouts: the conformer cache is oldest-first (so this keeps the prompt and the newest
        frames), the DiT cache is newest-first by chunk (so this keeps the newest prompt_frames entries and
        the 100 oldest, i.e. the prompt's tail). We reproduce that exactly so output matches the
        reference; either way memory stays bounded for arbitrarily long streams.
        """
        return FlowCache(self.conformer_cnn, keep_prompt_and_recent(self.conformer_att, 3, prompt_frames, recent_frames),
                         self.estimator_cnn, keep_prompt_and_recent(self.estimator_att, 4, prompt_frames, recent_frames))


def keep_prompt_and_recent(cache: torch.Tensor, dim: int, prompt_frames: int, recent_frames: int) -> torch.Tensor:
    """Upstream's cut of an attention cache: once longer than prompt_frames + recent_frames along
    ``dim``, its first prompt_frames and last recent_frames entries; else ``cache`` itself."""
    if cache.shape[dim] <= prompt_frames + recent_frames:
        return cache
    return torch.cat([cache.narrow(dim, 0, prompt_frames),
                      cache.narrow(dim, cache.shape[dim] - recent_frames, recent_frames)], dim=dim)


class CausalMaskedDiffWithXvec(nn.Module):
    def __init__(
        self,
        input_size: int = 512,
        output_size: int = 80,
        spk_embed_dim: int = 192,
        output_type: str = "mel",
        vocab_size: int = 5121,
        encoder: Optional[UpsampleConformerEncoderV2] = None,
        decoder: Optional[CausalConditionalCFM] = None,
        **_unused: object,
    ):
        super().__init__()
        if encoder is None or decoder is None:
            raise ValueError("CausalMaskedDiffWithXvec needs an encoder and a decoder")
        self.input_size = input_size
        self.output_size = output_size
        self.vocab_size = vocab_size
        self.output_type = output_type
        self.pre_lookahead_len = int(encoder.pre_lookahead_layer.pre_lookahead_len)
        self.up_rate = int(encoder.up_layer.stride)
        self.input_embedding = nn.Embedding(vocab_size, input_size)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, output_size)
        self.encoder = encoder
        self.encoder_proj = nn.Linear(encoder.output_size(), output_size)
        self.decoder = decoder

    def project_speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        """(1, spk_embed_dim) raw speaker embedding -> (1, output_size), L2-normalised first."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    @torch.inference_mode()
    def inference(
        self,
        token: torch.Tensor,
        prompt_token: torch.Tensor,
        prompt_feat: torch.Tensor,
        embedding: torch.Tensor,
        noise: NoiseFn,
        n_timesteps: int = 10,
    ) -> torch.Tensor:
        """Offline: token (1, T), prompt_token (1, Tp), prompt_feat (1, 2*Tp, 80), embedding (1, 192).

        Returns the mel of the new tokens only, (1, 80, T*up_rate).
        """
        spks = self.project_speaker(embedding)
        tokens = torch.cat([prompt_token, token], dim=1)
        lengths = torch.tensor([tokens.shape[1]], device=tokens.device)
        h, _ = self.encoder(self.input_embedding(tokens.clamp(min=0).long()), lengths)
        h = self.encoder_proj(h)
        prompt_len = prompt_feat.shape[1]
        conds = torch.zeros_like(h)
        conds[:, :prompt_len] = prompt_feat.to(h.dtype)
        total = h.shape[1]
        mask = torch.ones(1, 1, total, dtype=h.dtype, device=h.device)
        mel = self.decoder(h.transpose(1, 2).contiguous(), mask, spks, conds.transpose(1, 2).contiguous(),
                           noise(0, total), n_timesteps)
        return mel[:, :, prompt_len:]

    @torch.inference_mode()
    def setup_cache(
        self,
        token: torch.Tensor,
        mel: torch.Tensor,
        spk: torch.Tensor,
        noise: NoiseFn,
        n_timesteps: int = 10,
    ) -> FlowCache:
        """Run the prompt through encoder and estimator to fill the streaming caches.

        token (1, Tp + lookahead) = prompt tokens plus the lookahead pad; mel (1, Tp*up_rate, 80).
        """
        if (token.shape[1] - self.pre_lookahead_len) * self.up_rate != mel.shape[1]:
            raise ValueError(f"prompt tokens {tuple(token.shape)} (with lookahead) do not match prompt mel {tuple(mel.shape)}")
        spks = self.project_speaker(spk)
        h, conformer_cnn, conformer_att = self.encoder.forward_chunk(self.input_embedding(token.long()), False, None, None)
        h = self.encoder_proj(h)
        _, estimator_cnn, estimator_att = self.decoder.forward_chunk(
            h.transpose(1, 2).contiguous(), spks, mel.to(h.dtype).transpose(1, 2).contiguous(),
            noise(0, h.shape[1]), n_timesteps,
        )
        return FlowCache(conformer_cnn, conformer_att, estimator_cnn, estimator_att)

    @torch.inference_mode()
    def inference_chunk(
        self,
        token: torch.Tensor,
        spk: torch.Tensor,
        cache: FlowCache,
        last_chunk: bool,
        noise: NoiseFn,
        n_timesteps: int = 10,
        projected_spk: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, FlowCache]:
        """One streaming chunk: token (1, t + lookahead), or (1, t) when last_chunk.

        Returns mel (1, 80, t*up_rate) and the new (untruncated) cache; the input cache is not modified.
        ``projected_spk`` lets the engine reuse the voice's projected embedding.
        """
        spks = projected_spk if projected_spk is not None else self.project_speaker(spk)
        h, conformer_cnn, conformer_att = self.encoder.forward_chunk(
            self.input_embedding(token.long()), last_chunk, cache.conformer_cnn, cache.conformer_att
        )
        h = self.encoder_proj(h)
        mu = h.transpose(1, 2).contiguous()
        mel, estimator_cnn, estimator_att = self.decoder.forward_chunk(
            mu, spks, torch.zeros_like(mu), noise(cache.estimator_att.shape[4], h.shape[1]), n_timesteps,
            cache.estimator_cnn, cache.estimator_att,
        )
        return mel, FlowCache(conformer_cnn, conformer_att, estimator_cnn, estimator_att)
