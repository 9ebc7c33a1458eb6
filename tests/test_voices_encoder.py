"""The voice encoder's feature extraction against independent references, and its ONNX plumbing.

* Kaldi fbank vs ``kaldi-native-fbank`` (the standalone Kaldi implementation): max |diff| < 1e-3
  on log energies (measured 5e-5; float32 vs float64 arithmetic).
* The mel filters vs golden values of s3tokenizer's shipped ``mel_filters.npz`` (rtol 1e-5).
* The whisper log-mel and the prompt mel vs torch formulations of the reference recipes
  (``torch.stft`` with its own centring/padding and window; our numpy code shares only the mel
  filter matrix): max |diff| < 1e-4. (Against s3tokenizer's own recipe with its own filters on its
  two real-speech assets: max |diff| 2.7e-5, measured once; not in CI, the package needs torchaudio.)
* The encoder on tiny ONNX models with the real signatures: shapes, dtypes, trimming, hash.
"""

from __future__ import annotations

from pathlib import Path

import kaldi_native_fbank as knf
import numpy as np
import onnx
import pytest
import torch

from backends.voices.encoder import CAMPPLUS_FILE, TOKENIZER_FILE, VoiceEncoder, model_files_hash
from backends.voices.features import kaldi_fbank, prompt_mel, slaney_mel_filters, whisper_log_mel
from backends.voices.tiny_onnx import write_tiny_encoder_models


def golden_audio(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.3 * np.sin(2 * np.pi * (180 * t + 40 * t * t)) + 0.1 * np.sin(2 * np.pi * 2300 * t) + 0.02 * rng.standard_normal(t.size)
    return x.astype(np.float32)


def test_kaldi_fbank_matches_kaldi_native_fbank() -> None:
    audio = golden_audio(2.345, 16_000)
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0
    opts.frame_opts.samp_freq = 16_000
    opts.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16_000, audio.tolist())
    fbank.input_finished()
    reference = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])
    ours = kaldi_fbank(audio)
    assert ours.shape == reference.shape == (1 + (audio.size - 400) // 160, 80)
    assert np.abs(ours - reference).max() < 1e-3


def test_slaney_filters_properties() -> None:
    filters = slaney_mel_filters(16_000, 400, 128)
    assert filters.shape == (128, 201) and (filters >= 0).all()
    assert (filters.sum(axis=1) > 0).all()  # no empty band at 128 bins / 400-point FFT
    # Slaney normalisation: each triangle has unit area in Hz; the sampled sum shows it once bands
    # span many FFT bins (the upper third here), while narrow low bands are single samples.
    area = filters.sum(axis=1) * (16_000 / 400)
    assert np.allclose(area[90:], 1.0, rtol=0.05)
    # Centres follow the Slaney scale: linear (66.67 Hz per mel) below 1 kHz.
    centres = filters.argmax(axis=1) * (16_000 / 400)
    assert np.all(np.diff(centres) >= 0) and centres[-1] > 7000


#: Golden values from s3tokenizer 0.3.0's ``assets/mel_filters.npz`` (librosa's filters, which the
#: S3 tokenizer's log-mel uses): whole-matrix sum, and the non-zero weights of three rows.
#: Our filters matched that file to 3.7e-9 max |diff| when it was at hand.
GOLDEN_MEL_128 = {
    "sum": 3.1909854412078857,
    0: ([1], [0.012373987]),
    64: ([42, 43], [0.0067496826, 0.018091518]),
    127: (list(range(191, 200)), [0.00047569509, 0.0016171717, 0.0027586485, 0.0039001252, 0.0050416016,
                                  0.0044571208, 0.0033428406, 0.0022285604, 0.0011142802]),
}


def test_mel_filters_match_the_s3_tokenizer_golden_values() -> None:
    filters = slaney_mel_filters(16_000, 400, 128)
    assert abs(float(filters.sum()) - GOLDEN_MEL_128["sum"]) < 1e-5
    for row in (0, 64, 127):
        bins, weights = GOLDEN_MEL_128[row]
        assert np.nonzero(filters[row])[0].tolist() == bins
        np.testing.assert_allclose(filters[row, bins], weights, rtol=1e-5, atol=1e-9)


def test_whisper_log_mel_matches_torch_reference() -> None:
    audio = golden_audio(3.0, 16_000)
    x = torch.from_numpy(audio).double()
    stft = torch.stft(x, 400, 160, window=torch.hann_window(400, dtype=torch.float64), return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = torch.from_numpy(slaney_mel_filters(16_000, 400, 128)).double() @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    reference = ((log_spec + 4.0) / 4.0).numpy()
    ours = whisper_log_mel(audio)
    assert ours.shape == reference.shape == (128, audio.size // 160)
    assert np.abs(ours - reference).max() < 1e-4


def test_prompt_mel_matches_torch_reference() -> None:
    audio = golden_audio(2.02, 24_000, seed=1)
    x = torch.from_numpy(audio).double()[None, None]
    x = torch.nn.functional.pad(x, (720, 720), mode="reflect")[0, 0]
    spec = torch.stft(
        x, 1920, 480, 1920, window=torch.hann_window(1920, dtype=torch.float64), center=False, return_complex=True
    )
    magnitude = torch.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    mel = torch.from_numpy(slaney_mel_filters(24_000, 1920, 80, 0.0, 8000.0)).double() @ magnitude
    reference = torch.log(torch.clamp(mel, min=1e-5)).T.numpy()
    ours = prompt_mel(audio)
    assert ours.shape == reference.shape == (audio.size // 480, 80)
    assert np.abs(ours - reference).max() < 1e-4


def test_tiny_models_have_the_real_signatures(tmp_path: Path) -> None:
    write_tiny_encoder_models(tmp_path)
    tok = onnx.load(str(tmp_path / TOKENIZER_FILE)).graph
    assert [i.type.tensor_type.elem_type for i in tok.input] == [onnx.TensorProto.FLOAT, onnx.TensorProto.INT32]
    assert [d.dim_value for d in tok.input[0].type.tensor_type.shape.dim][:2] == [1, 128]
    cam = onnx.load(str(tmp_path / CAMPPLUS_FILE)).graph
    assert [d.dim_value for d in cam.input[0].type.tensor_type.shape.dim][2] == 80
    assert [d.dim_value for d in cam.output[0].type.tensor_type.shape.dim] == [1, 192]


@pytest.mark.parametrize("seconds", [1.0, 2.73, 7.5])
def test_encoder_output_shapes_and_trimming(tmp_path: Path, seconds: float) -> None:
    write_tiny_encoder_models(tmp_path, seed=5)
    encoder = VoiceEncoder(tmp_path)
    prompt = encoder.encode(golden_audio(seconds, 16_000), golden_audio(seconds, 24_000))
    tokens = prompt.prompt_tokens
    assert tokens.dtype == np.int32 and tokens.ndim == 1 and 0 <= tokens.min() and tokens.max() <= 6560
    assert abs(tokens.size - seconds * 25) <= 1
    assert prompt.prompt_mel.shape == (2 * tokens.size, 80) and prompt.prompt_mel.dtype == np.float32
    assert prompt.speaker_embedding.shape == (192,) and np.isfinite(prompt.speaker_embedding).all()
    assert prompt.model_hash == model_files_hash(tmp_path) and len(prompt.model_hash) == 64


def test_model_hash_changes_with_the_models(tmp_path: Path) -> None:
    a, b = write_tiny_encoder_models(tmp_path / "a", seed=1), write_tiny_encoder_models(tmp_path / "b", seed=2)
    assert model_files_hash(a) != model_files_hash(b)
    assert model_files_hash(a) == model_files_hash(write_tiny_encoder_models(tmp_path / "c", seed=1))


# --- built-in presets from wav + transcript pairs and from a CosyVoice2 spk2info.pt --------------------


def wav_bytes(audio: np.ndarray, rate: int) -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((audio * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


async def test_presets_from_wav_and_transcript(tmp_path: Path) -> None:
    from backends.voices.import_presets import import_wav_dir
    from gateway.voices import VoiceRegistry

    encoder_dir = write_tiny_encoder_models(tmp_path / "enc")
    src = tmp_path / "src"
    src.mkdir()
    (src / "default.wav").write_bytes(wav_bytes(golden_audio(2.0, 24_000), 24_000))
    (src / "alloy.wav").write_bytes(wav_bytes(golden_audio(3.0, 24_000, seed=2), 24_000))
    (src / "alloy.txt").write_text("This is alloy speaking.\n", encoding="utf-8")
    written = import_wav_dir(src, tmp_path / "voices", encoder_dir)
    assert sorted(p.name for p in written) == ["alloy.npz", "default.npz"]
    registry = VoiceRegistry(tmp_path / "voices")
    registry.load()
    alloy, echo = await registry.resolve("alloy"), await registry.resolve("echo")
    assert alloy.prompt_text == "This is alloy speaking." and abs(alloy.prompt_tokens.size - 75) <= 1
    assert echo.id == "default" and echo.prompt_text == "" and alloy.model_hash == model_files_hash(encoder_dir)


def test_presets_from_cosyvoice2_spk2info(tmp_path: Path) -> None:
    from backends.voices.import_presets import import_spk2info
    from gateway.voices import load_voice

    rng = np.random.default_rng(0)
    zero_shot = {
        "prompt_text": "hello",  # upstream stores LLM token ids; a plain string is accepted too
        "flow_prompt_speech_token": torch.from_numpy(rng.integers(0, 6561, (1, 40), dtype=np.int32)),
        "prompt_speech_feat": torch.from_numpy(rng.normal(size=(1, 81, 80)).astype(np.float32)),
        "flow_embedding": torch.from_numpy(rng.normal(size=(1, 192)).astype(np.float32)),
    }
    sft_only = {"embedding": torch.zeros(1, 192)}
    torch.save({"speaker_a": zero_shot, "sft": sft_only}, tmp_path / "spk2info.pt")
    written = import_spk2info(tmp_path / "spk2info.pt", tmp_path / "voices")
    assert [p.name for p in written] == ["speaker_a.npz"]
    voice = load_voice(written[0])
    assert voice.prompt_text == "hello" and voice.prompt_tokens.size == 40 and voice.prompt_mel.shape == (80, 80)
    np.testing.assert_array_equal(voice.prompt_tokens, zero_shot["flow_prompt_speech_token"].numpy()[0])
    assert voice.model_hash.startswith("spk2info:")
