"""Our flow vs the reference (stepaudio2-minicpmo 0.1.1) on the same tiny random weights.

The fixture comes from tests/golden/make_flow_fixtures.py (run in a throwaway venv with the
reference installed). Same weights, same inputs, same noise (the reference's noise buffer, indexed
by the estimator cache length exactly as the reference does) -> the mels must match.
Tolerance: 1e-4 absolute on mels of magnitude ~5 (measured: bit-identical on x86 CPU, float32).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.token2wav.config import build_flow_from_yaml, flow_yaml_text, load_flow, parse_flow_yaml
from backends.token2wav.dit_cache import DiTCacheRing
from backends.token2wav.flow import keep_prompt_and_recent
from backends.token2wav.tiny import write_token2wav_dir

FIXTURE = Path(__file__).parent / "golden" / "fixtures" / "flow_tiny.pt"
ATOL = 1e-4


@pytest.fixture(scope="module")
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(single_thread):
    return torch.load(FIXTURE, weights_only=False)


@pytest.fixture(scope="module", params=["as_loaded", "frozen"])
def flow(reference, request):
    """The flow as loaded, and after ``decoder.freeze`` (precomputed step modulations and stacked q/k
    weights: the engine's path). Both must match the reference."""
    model = build_flow_from_yaml(flow_yaml_text(**reference["flow_yaml_kwargs"])).eval()
    model.load_state_dict(reference["state_dict"], strict=True)
    if request.param == "frozen":
        model.decoder.freeze(reference["n_timesteps"])
        assert model.decoder.estimator.blocks[0].attn.qkv_weight is not None
        # what freeze derives is not part of the checkpoint layout
        assert set(model.state_dict()) == set(reference["state_dict"])
    return model


def _noise_fn(reference):
    noise = reference["noise"]

    def take(offset: int, n_frames: int) -> torch.Tensor:
        assert offset + n_frames <= noise.shape[2], "fixture noise too short"
        return noise[:, :, offset:offset + n_frames]

    return take


def test_offline_mel_matches_reference(flow, reference):
    mel = flow.inference(reference["tokens"], reference["prompt_token"], reference["prompt_mel"], reference["spk"],
                         _noise_fn(reference), reference["n_timesteps"])
    expected = reference["offline_mel"]
    assert mel.shape == expected.shape == (1, 80, 2 * reference["tokens"].shape[1])
    assert expected.abs().max() > 1.0  # a non-trivial signal
    torch.testing.assert_close(mel, expected, atol=ATOL, rtol=0)


def test_streaming_chunks_match_reference_including_cache_truncation(flow, reference):
    prompt_frames = reference["prompt_mel"].shape[1]
    pad = torch.full((1, 3), 4218)
    noise = _noise_fn(reference)
    cache = flow.setup_cache(torch.cat([reference["prompt_token"], pad], dim=1), reference["prompt_mel"],
                             reference["spk"], noise, reference["n_timesteps"])
    sizes = reference["chunk_sizes"].tolist()
    done = 0
    for index, (size, expected, expected_len) in enumerate(
            zip(sizes, reference["chunk_mels"], reference["cache_lens"].tolist())):
        last = index == len(sizes) - 1
        mel, cache = flow.inference_chunk(reference["tokens"][:, done:done + size], reference["spk"], cache, last,
                                          noise, reference["n_timesteps"])
        cache = cache.truncated(prompt_frames)
        assert mel.shape == expected.shape
        torch.testing.assert_close(mel, expected, atol=ATOL, rtol=0, msg=f"chunk {index}")
        assert cache.estimator_att.shape[4] == expected_len
        done += size - 3
    # the fixture's schedule made both caches exceed prompt + 100 frames, so truncation was exercised
    assert max(reference["cache_lens"].tolist()) == prompt_frames + 100


def _entry_ids(frames: int, first: int) -> torch.Tensor:
    """A chunk (1 step, 1 block, 2 halves, 1 head, frames, 2) of keys/values that name their frame: ids
    ``first`` ... in frame order, negated in the uncond half (so the halves cannot be swapped unnoticed)."""
    ids = torch.arange(first, first + frames, dtype=torch.float64)
    return torch.stack([ids, -ids]).reshape(1, 1, 2, 1, frames, 1).expand(-1, -1, -1, -1, -1, 2)


@pytest.mark.parametrize("prompt_frames", [2, 60, 100, 150, 300])
@pytest.mark.parametrize("chunks", [[36, 50, 50, 50, 50, 50, 50, 50, 50, 50], [36, 200, 200, 200, 6],
                                    [1, 2, 3, 400, 7, 99, 301, 50, 1, 1, 1], [250, 250], [10] * 60])
def test_dit_cache_ring_keeps_what_upstream_keeps(prompt_frames, chunks):
    """The engine's ring holds exactly the entries upstream's prepend-then-cut keeps (up to their order,
    which the DiT's attention does not see), for prompts shorter and longer than the 100 recent frames,
    chunks longer than the prompt, many chunks around the ring, and both CFG halves."""
    recent = 100
    upstream = _entry_ids(prompt_frames, 0)
    ring = DiTCacheRing.from_prompt(upstream, width=prompt_frames + recent + 37, recent_frames=recent)
    first = prompt_frames
    for frames in chunks:
        chunk = _entry_ids(frames, first)
        first += frames
        upstream = keep_prompt_and_recent(torch.cat([chunk, upstream], dim=4), 4, prompt_frames, recent)
        ring.add(chunk.movedim(2, 0))
        kept = ring.kept()
        assert kept.shape == upstream.shape
        for half in range(2):
            assert torch.equal(kept[0, 0, half, 0, :, 0].sort().values, upstream[0, 0, half, 0, :, 0].sort().values)
        assert torch.equal(kept[..., 0], kept[..., 1])
    start, _ = ring.held_positions()
    assert not ring.kv[..., :start, :].any() and not ring.kv[..., ring.limit:, :].any()   # never written: zeros


def test_tiny_dir_loads_strictly_in_published_layout(tmp_path):
    write_token2wav_dir(tmp_path, "tiny", seed=1)
    text = (tmp_path / "flow.yaml").read_text()
    assert "flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec" in text
    assert "!new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2" in text
    model = load_flow(tmp_path / "flow.yaml")
    state = torch.load(tmp_path / "flow.pt", weights_only=True)
    assert "decoder.estimator.blocks.0.adaLN_modulation.1.weight" in state
    assert "encoder.up_encoders.0.self_attn.pos_bias_u" in state
    model.load_state_dict(state, strict=True)
    # a missing key must fail a strict load (proves strictness is real)
    state.pop("encoder_proj.weight")
    with pytest.raises(RuntimeError, match="encoder_proj.weight"):
        model.load_state_dict(state, strict=True)


def test_full_size_yaml_has_published_parameter_count():
    kwargs = dict(
        flow=dict(input_size=512, output_size=80, spk_embed_dim=192, output_type="mel", vocab_size=6561),
        encoder=dict(input_size=512, output_size=512, input_layer="linear", pre_lookahead_len=3, num_blocks=6,
                     num_up_blocks=4, up_stride=2, up_scale_factor=2, attention_heads=8,
                     pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", key_bias=True,
                     linear_units=2048, dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.1,
                     normalize_before=True),
        decoder=dict(inference_cfg_rate=0.7),
        estimator=dict(in_channels=320, out_channels=80, mlp_ratio=4.0, depth=16, num_heads=8, head_dim=64,
                       hidden_size=512),
    )
    with torch.device("meta"):
        model = build_flow_from_yaml(flow_yaml_text(**kwargs))
    total = sum(p.numel() for p in model.parameters())
    assert round(total / 1e6, 1) == 155.8


def test_yaml_with_extra_keys_and_other_tags_is_accepted():
    text = flow_yaml_text(**torch.load(FIXTURE, weights_only=False)["flow_yaml_kwargs"])
    text = "sample_rate: 24000\nsomething: !name:other.module.fn\n" + text + "extra: !ref <sample_rate>\n"
    assert parse_flow_yaml(text)["sample_rate"] == 24000
    model = build_flow_from_yaml(text)
    assert model.pre_lookahead_len == 3 and model.up_rate == 2


def test_unknown_class_in_flow_is_rejected():
    text = "flow: !new:cosyvoice2.flow.flow.SomethingElse\n    input_size: 4\n"
    with pytest.raises(ValueError, match="unsupported class"):
        build_flow_from_yaml(text)
