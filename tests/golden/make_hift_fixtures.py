"""Build HiFT parity fixtures from the reference implementation (run in a THROWAWAY env, not .venv).

Reference: PyPI `stepaudio2-minicpmo` (0.1.1), module `stepaudio2.flashcosyvoice.modules.hifigan`
(HiFTGenerator, ConvRNNF0Predictor) and `...hifigan_components.layers` (ResBlock, Snake, SineGen2,
SourceModuleHnNSF2). At 24 kHz the reference uses SourceModuleHnNSF2, as does the published model.

Environment used (no internet beyond PyPI, so torch came from the project venv):
    python3.11 -m venv /tmp/refhift
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/refhift/lib/python3.11/site-packages/mainvenv.pth
    /tmp/refhift/bin/pip install "numpy<2" scipy
    /tmp/refhift/bin/pip install --no-deps stepaudio2-minicpmo
    cd /work/main && /tmp/refhift/bin/python tests/golden/make_hift_fixtures.py

Patches to the reference: none to its code. The package's `__init__` files import torchaudio,
s3tokenizer, hyperpyyaml, ... which the vocoder does not need, so this script registers empty
package modules for `stepaudio2`, `stepaudio2.flashcosyvoice` and `stepaudio2.flashcosyvoice.modules`
(with the real `__path__`) and imports only the hifigan modules. The vocoder has no `.cuda()` call.

Deterministic noise: the reference draws its NSF randomness from torch's global RNG, in this order per
call: `torch.rand(B, H)` (start phases), `torch.randn_like(sines)` [B, L, H] (additive noise; `sines` is
a transposed view, and torch samples non-contiguous tensors with a different loop), then an unused
`randn_like(uv)`. We seed the global RNG before each reference call; our implementation, built with
`reference_noise_layout=True`, draws the same shapes, strides and order from a `torch.Generator` seeded
with the same value, so the noise is identical (both are the CPU Mersenne-Twister stream) and parity is
compared with the noise ON. (Our default draws contiguously: same distribution, ~15x faster on CPU.)

Weights: the reference's own init at TINY config (base 32 channels, F0 predictor 32 channels), except
the F0 head: its weights are scaled by 1500 and its bias set to -40 Hz so F0 spans voiced and unvoiced
frames (otherwise F0 ~ |bias| < 10 Hz: every frame unvoiced, the harmonic branch untested).

Writes tests/golden/fixtures/hift_tiny_state.pt (published layout: `generator.` prefix, old
weight_g/weight_v keys) and tests/golden/fixtures/hift_tiny_io.pt (config, mel, seeds, outputs of an
offline call and of a two-chunk streaming sequence).
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SEED_WEIGHTS = 1234
SEED_OFFLINE = 7
SEED_CHUNK1 = 11
SEED_CHUNK2 = 12
MEL_CACHE_FRAMES = 8  # upstream's streaming cross-fade cache: 8 mel frames = 3840 samples
TINY = {
    "in_channels": 80,
    "base_channels": 32,
    "nb_harmonics": 8,
    "sampling_rate": 24000,
    "nsf_alpha": 0.1,
    "nsf_sigma": 0.003,
    "nsf_voiced_threshold": 10,
    "upsample_rates": [8, 5, 3],
    "upsample_kernel_sizes": [16, 11, 7],
    "istft_params": {"n_fft": 16, "hop_len": 4},
    "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "source_resblock_kernel_sizes": [7, 7, 11],
    "source_resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "lrelu_slope": 0.1,
    "audio_limit": 0.99,
}
F0_CHANNELS = 32


def import_reference_hifigan() -> types.ModuleType:
    """Import the reference vocoder without running the package __init__ files (they need torchaudio)."""
    spec = importlib.util.find_spec("stepaudio2")
    assert spec is not None and spec.submodule_search_locations, "stepaudio2-minicpmo is not installed"
    root = Path(list(spec.submodule_search_locations)[0])
    for name, sub in [("stepaudio2", ""), ("stepaudio2.flashcosyvoice", "flashcosyvoice"),
                      ("stepaudio2.flashcosyvoice.modules", "flashcosyvoice/modules")]:
        package = types.ModuleType(name)
        package.__path__ = [str(root / sub)]
        sys.modules[name] = package
    return importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan")


def published_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`generator.` prefix and the old weight_g / weight_v keys."""
    out = {}
    for key, value in state.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        out["generator." + key] = value.detach().clone().contiguous()
    return out


def main() -> None:
    hifigan = import_reference_hifigan()
    torch.manual_seed(SEED_WEIGHTS)
    f0_predictor = hifigan.ConvRNNF0Predictor(in_channels=80, cond_channels=F0_CHANNELS)
    ref = hifigan.HiFTGenerator(**TINY, f0_predictor=f0_predictor)
    with torch.no_grad():
        ref.f0_predictor.classifier.weight.mul_(1500.0)
        ref.f0_predictor.classifier.bias.fill_(-40.0)
    ref.eval()

    mel_offline = torch.randn(2, 80, 20) * 2.0 - 4.0
    mel_stream = torch.randn(1, 80, 30) * 2.0 - 4.0
    chunk1, chunk2 = mel_stream[..., :18], mel_stream[..., 18:]

    torch.manual_seed(SEED_OFFLINE)
    wav_offline, source_offline = ref(mel_offline)

    # Two streaming calls the way Step-Audio2's token2wav drives the vocoder: the second call re-feeds
    # the last 8 mel frames in front of the new chunk and passes the matching excitation tail.
    torch.manual_seed(SEED_CHUNK1)
    wav1, source1 = ref(chunk1)
    cache_source = source1[:, :, -MEL_CACHE_FRAMES * 480:].clone()
    mel2 = torch.cat([chunk1[..., -MEL_CACHE_FRAMES:], chunk2], dim=2)
    torch.manual_seed(SEED_CHUNK2)
    wav2, source2 = ref(mel2, cache_source)

    with torch.no_grad():
        f0 = ref.f0_predictor(mel_offline)
    voiced = (f0 > TINY["nsf_voiced_threshold"]).float().mean().item()
    print(f"f0 range {f0.min().item():.1f}..{f0.max().item():.1f} Hz, voiced fraction {voiced:.2f}")
    print(f"wav offline std {wav_offline.std().item():.4f}, max |x| {wav_offline.abs().max().item():.4f}")

    FIXTURES.mkdir(parents=True, exist_ok=True)
    torch.save(published_layout(ref.state_dict()), FIXTURES / "hift_tiny_state.pt")
    config = {k: v for k, v in TINY.items()}
    config["f0_predictor_channels"] = F0_CHANNELS
    torch.save(
        {
            "config": config,
            "seeds": {"offline": SEED_OFFLINE, "chunk1": SEED_CHUNK1, "chunk2": SEED_CHUNK2},
            "mel_cache_frames": MEL_CACHE_FRAMES,
            "mel_offline": mel_offline,
            "wav_offline": wav_offline.clone(),
            "source_offline": source_offline.clone(),
            "mel_chunk1": chunk1.clone(),
            "wav_chunk1": wav1.clone(),
            "source_chunk1": source1.clone(),
            "mel_chunk2": mel2.clone(),
            "cache_source": cache_source,
            "wav_chunk2": wav2.clone(),
            "source_chunk2": source2.clone(),
        },
        FIXTURES / "hift_tiny_io.pt",
    )
    for path in sorted(FIXTURES.glob("hift_*")):
        print(path.name, path.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
