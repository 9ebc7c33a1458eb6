"""Write the flow parity fixtures from the reference implementation (run in a throwaway venv).

Environment (outside the repo, never committed):
    python3.11 -m venv /tmp/refenv
    /tmp/refenv/bin/pip install torch==2.13.0+cpu "numpy<2" einops onnxruntime
    /tmp/refenv/bin/pip install --no-deps stepaudio2-minicpmo==0.1.1
    /tmp/refenv/bin/python tests/golden/make_flow_fixtures.py

What is patched, all at run time inside this script (the installed files are not edited):
- ``stepaudio2/__init__.py`` is bypassed: an empty ``stepaudio2`` package module is registered in
  ``sys.modules`` so importing ``stepaudio2.cosyvoice2.*`` does not pull in its token2wav wrapper
  (which imports torchaudio, s3tokenizer, hyperpyyaml and calls ``.cuda()``). No torchaudio stub needed.
- ``CausalConditionalCFM.__init__`` is replaced by one that builds the same ``rand_noise`` buffer
  (``torch.randn([1, 80, 50*600])`` from the global RNG, as upstream) but sizes its two scratch cache
  buffers for the tiny config instead of the hard-coded 16x16x2x8x1000x128 (4 GiB) ones.
- ``DiT``'s ``att_cache_buffer`` / ``cnn_cache_buffer`` are replaced after construction by buffers of
  the tiny config's shape (upstream hard-codes 16 blocks x 512 hidden).
- The streaming loop and the cache truncation (prompt + last 100) are re-done here exactly as in the
  wrapper ``stepaudio2/token2wav.py::Token2wav.stream`` (which itself needs CUDA); caches returned by
  the reference are views of its scratch buffers, so they are cloned before being kept.

Output: tests/golden/fixtures/flow_tiny.pt (a dict of tensors, ~0.6 MB): the flow state dict in the
published flow.pt layout, the tiny flow.yaml text, inputs, the noise prefix the reference used, the
offline mel and the per-chunk streaming mels.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "fixtures" / "flow_tiny.pt"
SEED = 1234

# Tiny config: same structure as the published flow.yaml, small dims (encoder input_size must equal
# output_size because the reference's up_embed is Linear(input_size, output_size)).
FLOW = dict(input_size=16, output_size=80, spk_embed_dim=192, output_type="mel", vocab_size=6561)
ENCODER = dict(input_size=16, output_size=16, input_layer="linear", pre_lookahead_len=3, num_blocks=2,
               num_up_blocks=2, up_stride=2, up_scale_factor=2, attention_heads=2,
               pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", key_bias=True,
               linear_units=64, dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.1,
               normalize_before=True)
DECODER = dict(inference_cfg_rate=0.7)
ESTIMATOR = dict(in_channels=320, out_channels=80, mlp_ratio=2.0, depth=2, num_heads=2, head_dim=16, hidden_size=32)
N_STEPS = 10
PROMPT_TOKENS = 20          # prompt mel = 40 frames
GENERATED_TOKENS = 120      # streamed as 15+3, then 25, 50, ... (last chunk flushes)
MAX_CACHE_T = 1000


def import_reference():
    package = types.ModuleType("stepaudio2")
    import importlib.util
    spec = importlib.util.find_spec("stepaudio2")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["stepaudio2"] = package
    from stepaudio2.cosyvoice2.flow import decoder_dit, flow, flow_matching
    from stepaudio2.cosyvoice2.transformer import upsample_encoder_v2
    return flow, flow_matching, decoder_dit, upsample_encoder_v2


def patch_cfm_init(flow_matching, depth: int, hidden: int, heads: int, head_dim: int) -> None:
    def small_init(self, estimator, inference_cfg_rate: float = 0.7):
        torch.nn.Module.__init__(self)
        self.estimator = estimator
        self.inference_cfg_rate = inference_cfg_rate
        self.out_channels = estimator.out_channels
        self.register_buffer("rand_noise", torch.randn([1, self.out_channels, 50 * 600]), persistent=False)
        self.register_buffer("cnn_cache_buffer", torch.zeros(16, depth, 2, 2 * hidden, 2), persistent=False)
        self.register_buffer("att_cache_buffer", torch.zeros(16, depth, 2, heads, MAX_CACHE_T, 2 * head_dim),
                             persistent=False)

    flow_matching.CausalConditionalCFM.__init__ = small_init


def main() -> None:
    flow_mod, fm_mod, dit_mod, enc_mod = import_reference()
    patch_cfm_init(fm_mod, ESTIMATOR["depth"], ESTIMATOR["hidden_size"], ESTIMATOR["num_heads"], ESTIMATOR["head_dim"])
    torch.manual_seed(SEED)
    estimator = dit_mod.DiT(**ESTIMATOR)
    estimator.att_cache_buffer = torch.zeros(ESTIMATOR["depth"], 2, ESTIMATOR["num_heads"], MAX_CACHE_T,
                                             2 * ESTIMATOR["head_dim"])
    estimator.cnn_cache_buffer = torch.zeros(ESTIMATOR["depth"], 2, 2 * ESTIMATOR["hidden_size"], 2)
    decoder = fm_mod.CausalConditionalCFM(estimator, **DECODER)
    encoder = enc_mod.UpsampleConformerEncoderV2(**ENCODER)
    model = flow_mod.CausalMaskedDiffWithXvec(encoder=encoder, decoder=decoder, **FLOW).eval()
    # DiT zero-inits its adaLN / output layers; randomise every parameter so the test sees real signal.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn_like(param) * (0.5 / param.shape[-1] ** 0.5))
            else:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    state = {k: v.clone() for k, v in model.state_dict().items()}

    gen = torch.Generator().manual_seed(SEED + 1)
    prompt_token = torch.randint(0, 6561, (1, PROMPT_TOKENS), generator=gen, dtype=torch.int32)
    prompt_mel = torch.randn(1, 2 * PROMPT_TOKENS, 80, generator=gen) * 2 - 5
    spk = torch.randn(1, 192, generator=gen)
    tokens = torch.randint(0, 6561, (1, GENERATED_TOKENS), generator=gen, dtype=torch.int32)

    offline = model.inference(tokens, torch.tensor([GENERATED_TOKENS], dtype=torch.int32), prompt_token,
                              torch.tensor([PROMPT_TOKENS], dtype=torch.int32), prompt_mel,
                              torch.tensor([2 * PROMPT_TOKENS], dtype=torch.int32), spk, N_STEPS).clone()

    # Streaming, as Token2wav.set_stream_cache + Token2wav.stream do it (silence pad 4218 x3).
    pad = torch.full((1, 3), 4218, dtype=prompt_token.dtype)
    cache = model.setup_cache(torch.cat([prompt_token, pad], dim=1), prompt_mel, spk, n_timesteps=N_STEPS)
    cache = {k: v.clone() for k, v in cache.items()}
    prompt_frames = prompt_mel.shape[1]
    chunk_sizes, chunk_mels, cache_lens = [], [], []
    done, hop, first = 0, 25, True
    lookahead = model.pre_lookahead_len
    while True:
        size = 15 if first else hop
        remaining = GENERATED_TOKENS - done
        last = remaining < size + lookahead
        piece = tokens[:, done:] if last else tokens[:, done:done + size + lookahead]
        mel, cache = model.inference_chunk(piece, spk, cache, last_chunk=last, n_timesteps=N_STEPS)
        cache = {k: v.clone() for k, v in cache.items()}
        if cache["estimator_att_cache"].shape[4] > prompt_frames + 100:
            att = cache["estimator_att_cache"]
            cache["estimator_att_cache"] = torch.cat([att[..., :prompt_frames, :], att[..., -100:, :]], dim=4)
        if cache["conformer_att_cache"].shape[3] > prompt_frames + 100:
            att = cache["conformer_att_cache"]
            cache["conformer_att_cache"] = torch.cat([att[:, :, :, :prompt_frames], att[:, :, :, -100:]], dim=3)
        chunk_sizes.append(piece.shape[1])
        chunk_mels.append(mel.clone())
        cache_lens.append(cache["estimator_att_cache"].shape[4])
        if last:
            break
        done += size
        if not first:
            hop *= 2
        first = False

    fixture = {
        "flow_yaml_kwargs": {"flow": FLOW, "encoder": ENCODER, "decoder": DECODER, "estimator": ESTIMATOR},
        "state_dict": state,
        "prompt_token": prompt_token,
        "prompt_mel": prompt_mel,
        "spk": spk,
        "tokens": tokens,
        "noise": model.decoder.rand_noise[:, :, :400].clone(),
        "offline_mel": offline,
        "chunk_sizes": torch.tensor(chunk_sizes),
        "chunk_mels": chunk_mels,
        "cache_lens": torch.tensor(cache_lens),
        "n_timesteps": N_STEPS,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); chunks {chunk_sizes}; cache lens {cache_lens}")


if __name__ == "__main__":
    main()
