"""The three feature extractors a voice needs, in numpy (no torch: they run in the gateway process).

* ``whisper_log_mel`` -- the 128-bin log-mel the S3 tokenizer computes (whisper's recipe: 400-point
  periodic Hann STFT, hop 160, centred with reflect padding, last frame dropped, power spectrum,
  Slaney mel filters, log10 clamped at 1e-10, floor at max - 8, then (x + 4) / 4).
* ``kaldi_fbank`` -- Kaldi's ``compute-fbank-feats`` defaults as torchaudio / kaldi-native-fbank
  implement them (25 ms / 10 ms frames, snip edges, DC removal, pre-emphasis 0.97, Povey window,
  512-point power spectrum, Kaldi mel bins from 20 Hz to Nyquist, log floored at float32 epsilon),
  dither 0.
* ``prompt_mel`` -- CosyVoice's 24 kHz mel (n_fft 1920, hop 480, win 1920, 80 bins, 0-8000 Hz,
  reflect padding of (n_fft - hop) / 2, magnitude with +1e-9 inside the sqrt, natural log clamped
  at 1e-5), returned frames-first.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def _hz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    freq = np.asarray(freq, np.float64)
    f_sp = 200.0 / 3
    mels = freq / f_sp
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    return np.where(freq >= min_log_hz, min_log_mel + np.log(np.maximum(freq, 1e-10) / min_log_hz) / logstep, mels)


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    return np.where(mels >= min_log_mel, min_log_hz * np.exp(logstep * (mels - min_log_mel)), f_sp * mels)


@lru_cache(maxsize=8)
def slaney_mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] triangular filters, Slaney scale and area normalisation (librosa's defaults)."""
    fmax = sr / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    mel_f = _mel_to_hz_slaney(np.linspace(_hz_to_mel_slaney(fmin), _hz_to_mel_slaney(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return weights.astype(np.float32)


def _periodic_hann(n: int) -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float64)


def _frames(x: np.ndarray, size: int, hop: int) -> np.ndarray:
    count = 1 + (x.size - size) // hop
    if count <= 0:
        return np.zeros((0, size), x.dtype)
    return np.lib.stride_tricks.sliding_window_view(x, size)[::hop][:count]


def whisper_log_mel(audio_16k: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """float32 [n_mels, T] (T = len // 160) from float32 mono 16 kHz audio."""
    n_fft, hop = 400, 160
    x = np.asarray(audio_16k, np.float64)
    x = np.pad(x, n_fft // 2, mode="reflect")
    spec = np.fft.rfft(_frames(x, n_fft, hop) * _periodic_hann(n_fft), axis=-1)
    power = (np.abs(spec) ** 2)[:-1].T  # [freq, frames], last frame dropped as whisper does
    mel = slaney_mel_filters(16000, n_fft, n_mels).astype(np.float64) @ power
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0) if log_spec.size else log_spec
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def _kaldi_mel(freq: np.ndarray) -> np.ndarray:
    return 1127.0 * np.log(1.0 + freq / 700.0)


@lru_cache(maxsize=4)
def kaldi_mel_banks(num_bins: int, padded: int, sr: float, low_freq: float = 20.0, high_freq: float = 0.0) -> np.ndarray:
    """[num_bins, padded // 2 + 1] Kaldi mel banks (the Nyquist column is zero, as in Kaldi)."""
    nyquist = sr / 2
    high = high_freq if high_freq > 0 else nyquist + high_freq
    mel_low, mel_high = _kaldi_mel(np.float64(low_freq)), _kaldi_mel(np.float64(high))
    delta = (mel_high - mel_low) / (num_bins + 1)
    mel = _kaldi_mel(np.arange(padded // 2) * (sr / padded))
    i = np.arange(num_bins)[:, None]
    left, center, right = mel_low + i * delta, mel_low + (i + 1) * delta, mel_low + (i + 2) * delta
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = np.maximum(0.0, np.minimum(up, down))
    return np.pad(banks, ((0, 0), (0, 1)))


def kaldi_fbank(audio_16k: np.ndarray, num_bins: int = 80, sr: int = 16000) -> np.ndarray:
    """float32 [T, num_bins] log mel filterbank, Kaldi defaults, dither 0 (input scale as given)."""
    size, hop, padded = int(sr * 0.025), int(sr * 0.010), 512
    frames = _frames(np.asarray(audio_16k, np.float64), size, hop).copy()
    if frames.shape[0] == 0:
        return np.zeros((0, num_bins), np.float32)
    frames -= frames.mean(axis=1, keepdims=True)
    shifted = np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)
    frames = frames - 0.97 * shifted
    povey = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(size) / (size - 1))) ** 0.85
    frames *= povey
    power = np.abs(np.fft.rfft(frames, n=padded, axis=1)) ** 2
    mel = power @ kaldi_mel_banks(num_bins, padded, float(sr)).T
    return np.log(np.maximum(mel, np.finfo(np.float32).eps)).astype(np.float32)


def prompt_mel(audio_24k: np.ndarray) -> np.ndarray:
    """float32 [T, 80] (T = len // 480) CosyVoice prompt mel of float32 mono 24 kHz audio."""
    n_fft, hop = 1920, 480
    x = np.asarray(audio_24k, np.float64)
    pad = (n_fft - hop) // 2
    x = np.pad(x, pad, mode="reflect")
    spec = np.fft.rfft(_frames(x, n_fft, hop) * _periodic_hann(n_fft), axis=-1)
    magnitude = np.sqrt(spec.real**2 + spec.imag**2 + 1e-9)  # [frames, freq]
    mel = magnitude @ slaney_mel_filters(24000, n_fft, 80, 0.0, 8000.0).astype(np.float64).T
    return np.log(np.maximum(mel, 1e-5)).astype(np.float32)
