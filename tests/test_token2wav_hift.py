"""HiFT vocoder behaviour: checkpoint layouts, lengths, cache_source, per-stream noise, low precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.token2wav.hift import (
    DEFAULT_HIFT_CONFIG,
    TINY_HIFT_CONFIG,
    HiFTGenerator,
    load_hift,
    write_random_hift,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """The same random weights written in both weight-norm layouts."""
    root = tmp_path_factory.mktemp("hift")
    old, new = root / "hift_old.pt", root / "hift_new.pt"
    config = write_random_hift(old, TINY_HIFT_CONFIG, seed=3, old_weight_norm=True)
    write_random_hift(new, TINY_HIFT_CONFIG, seed=3, old_weight_norm=False)
    return {"old": old, "new": new, "config": config}


@pytest.fixture(scope="module")
def hift(checkpoints) -> HiFTGenerator:
    return load_hift(checkpoints["old"], **checkpoints["config"])


def _mel(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed)) * 2.0 - 4.0


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_published_defaults_have_the_published_size() -> None:
    params = sum(p.numel() for p in HiFTGenerator(**DEFAULT_HIFT_CONFIG).parameters())
    assert 20.7e6 < params < 20.9e6  # ARCHITECTURE.md: 20.8 M


def test_written_checkpoint_uses_the_published_layout(checkpoints) -> None:
    old = torch.load(checkpoints["old"], weights_only=True)
    new = torch.load(checkpoints["new"], weights_only=True)
    assert all(k.startswith("generator.") for k in old) and all(k.startswith("generator.") for k in new)
    assert "generator.conv_pre.weight_g" in old and "generator.conv_pre.weight_v" in old
    assert "generator.f0_predictor.condnet.8.weight_v" in old
    assert "generator.resblocks.0.activations1.0.alpha" in old
    assert not any("parametrizations" in k for k in old)
    assert "generator.conv_pre.parametrizations.weight.original0" in new
    assert len(old) == len(new)


@pytest.mark.parametrize("fold", [True, False])
def test_both_weight_norm_forms_load_strictly_and_agree(checkpoints, fold) -> None:
    mel = _mel(1, 12)
    old = load_hift(checkpoints["old"], fold_weight_norm=fold, **checkpoints["config"])
    new = load_hift(checkpoints["new"], fold_weight_norm=fold, **checkpoints["config"])
    wav_old, _ = old.inference(mel, generator=_seeded(5))
    wav_new, _ = new.inference(mel, generator=_seeded(5))
    assert wav_old.abs().max() > 1e-3
    torch.testing.assert_close(wav_old, wav_new, rtol=0, atol=1e-6)


def test_a_wrong_config_fails_the_strict_load(checkpoints) -> None:
    with pytest.raises(RuntimeError):
        load_hift(checkpoints["old"], **{**checkpoints["config"], "base_channels": 64})


@pytest.mark.parametrize("batch,frames", [(1, 1), (1, 7), (2, 33)])
def test_output_length_is_480_samples_per_frame(hift, batch, frames) -> None:
    wav, source = hift.inference(_mel(batch, frames), generator=_seeded(0))
    assert wav.shape == (batch, frames * 480)
    assert source.shape == (batch, 1, frames * 480)
    assert wav.dtype == source.dtype == torch.float32
    assert wav.abs().max() <= TINY_HIFT_CONFIG["audio_limit"]


def test_cache_source_replaces_the_head_of_the_excitation(hift) -> None:
    mel = _mel(1, 20)
    _, plain = hift.inference(mel, generator=_seeded(9))
    cache = torch.randn(1, 1, 8 * 480) * 0.1
    wav_cached, cached = hift.inference(mel, cache, generator=_seeded(9))
    torch.testing.assert_close(cached[:, :, : cache.shape[-1]], cache, rtol=0, atol=0)
    torch.testing.assert_close(cached[:, :, cache.shape[-1] :], plain[:, :, cache.shape[-1] :], rtol=0, atol=0)
    wav_plain, _ = hift.inference(mel, generator=_seeded(9))
    assert (wav_cached - wav_plain)[:, : cache.shape[-1]].abs().max() > 1e-5  # the cache reached the output


def test_empty_cache_source_is_no_cache(hift) -> None:
    mel = _mel(1, 10)
    wav_none, _ = hift.inference(mel, generator=_seeded(4))
    wav_empty, _ = hift.inference(mel, torch.zeros(1, 1, 0), generator=_seeded(4))
    torch.testing.assert_close(wav_none, wav_empty, rtol=0, atol=0)


def test_cache_source_longer_than_the_chunk_is_rejected(hift) -> None:
    with pytest.raises(ValueError):
        hift.inference(_mel(1, 2), torch.zeros(1, 1, 3 * 480), generator=_seeded(0))


def test_streaming_with_cache_keeps_the_excitation_continuous(hift) -> None:
    """Upstream streaming: re-feed the last 8 mel frames and their excitation; the overlap repeats exactly."""
    mel = _mel(1, 30)
    _, source1 = hift.inference(mel[..., :18], generator=_seeded(1))
    tail = source1[:, :, -8 * 480 :]
    _, source2 = hift.inference(torch.cat([mel[..., 10:18], mel[..., 18:]], dim=2), tail, generator=_seeded(2))
    torch.testing.assert_close(source2[:, :, : 8 * 480], tail, rtol=0, atol=0)


def test_each_stream_noise_depends_only_on_its_own_generator(hift) -> None:
    mel = _mel(1, 10)
    solo, _ = hift.inference(mel, generator=_seeded(21))
    other = _seeded(22)
    hift.inference(_mel(1, 10, seed=1), generator=other)  # another stream runs in between
    torch.rand(1000)  # and someone uses the global RNG
    again, _ = hift.inference(mel, generator=_seeded(21))
    torch.testing.assert_close(solo, again, rtol=0, atol=0)
    _, solo_source = hift.inference(mel, generator=_seeded(21))
    different, different_source = hift.inference(mel, generator=_seeded(23))
    assert (solo_source - different_source).abs().max() > 1e-3
    assert (solo - different).abs().max() > 1e-6


def test_one_generator_per_row_equals_each_row_alone(hift) -> None:
    """Streams vocoded in one batch (engine.feed_many) each draw from their own generator: every row
    equals that stream's batch-1 call, so its audio does not depend on who it was batched with."""
    mel, cache = _mel(3, 12, seed=7), torch.randn(3, 1, 480) * 0.05
    batched, batched_source = hift.inference(mel, cache, generator=[_seeded(s) for s in (5, 6, 7)])
    for row, seed in enumerate((5, 6, 7)):
        alone, alone_source = hift.inference(mel[row:row + 1], cache[row:row + 1], generator=_seeded(seed))
        # batched convolutions round the F0 differently, and the phase carries it (~1e-5); another
        # noise draw would differ by > 1e-3 (test_each_stream_noise_depends_only_on_its_own_generator)
        torch.testing.assert_close(batched_source[row:row + 1], alone_source, rtol=0, atol=1e-4)
        torch.testing.assert_close(batched[row:row + 1], alone, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        hift.inference(mel, cache, generator=[_seeded(1), _seeded(2)])

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs_finite_and_close_to_float32(checkpoints, hift, dtype) -> None:
    mel = _mel(1, 25)
    reference, reference_source = hift.inference(mel, generator=_seeded(8))
    low = load_hift(checkpoints["old"], dtype=dtype, **checkpoints["config"])
    assert low.conv_pre.weight.dtype == dtype
    assert low.f0_predictor.classifier.weight.dtype == torch.float32  # pitch stays float32
    wav, source = low.inference(mel, generator=_seeded(8))
    assert torch.isfinite(wav).all() and torch.isfinite(source).all()
    torch.testing.assert_close(source, reference_source, rtol=0, atol=1e-6)
    relative_rms = ((wav - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()
    assert relative_rms < 0.05


def test_overlap_add_istft_equals_torch_istft(hift) -> None:
    """Our graph-capturable iSTFT is torch.istft's arithmetic (center=True, periodic Hann window)."""
    generator = _seeded(2)
    spec = torch.polar(torch.rand(2, 9, 37, generator=generator) * 3, torch.randn(2, 9, 37, generator=generator))
    expected = torch.istft(spec, 16, 4, 16, window=torch.hann_window(16))
    torch.testing.assert_close(hift._overlap_add_istft(spec), expected, rtol=0, atol=1e-6)


def test_cuda_graphs_flag_falls_back_to_eager_on_cpu(checkpoints, hift) -> None:
    graphed = load_hift(checkpoints["old"], cuda_graphs=True, **checkpoints["config"])
    mel = _mel(1, 9)
    expected, _ = hift.inference(mel, generator=_seeded(6))
    wav, _ = graphed.inference(mel, generator=_seeded(6))
    torch.testing.assert_close(wav, expected, rtol=0, atol=0)
    assert graphed._graphed_decode is not None and graphed._graphed_decode.num_graphs == 0


def test_fast_noise_has_the_reference_noise_distribution(hift) -> None:
    """The default path draws one mixed Gaussian per sample instead of one per harmonic: same spread."""
    source_module = hift.m_source
    unvoiced_f0 = torch.full((1, 48000, 1), 5.0)  # below the threshold: pure noise of amp sine_amp/3

    def pre_tanh_std(reference_layout: bool) -> float:
        source_module.reference_noise_layout = reference_layout
        draws = [torch.atanh(source_module(unvoiced_f0, _seeded(i))) for i in range(10)]
        return torch.stack(draws).std().item()

    try:
        reference_std, fast_std = pre_tanh_std(True), pre_tanh_std(False)
    finally:
        source_module.reference_noise_layout = False
    expected = source_module.sine_amp / 3 * source_module.l_linear.weight.norm().item()
    assert reference_std == pytest.approx(expected, rel=0.03)
    assert fast_std == pytest.approx(expected, rel=0.03)
