"""Uploaded audio → mono float32 at the rates the voice encoder needs, with the API's checks.

The container is sniffed from the bytes (never the filename or the part's content type: the SDK
sends raw bytes as ``upload`` / octet-stream), then PyAV (FFmpeg) decodes and resamples. Every
failure is a ``ValueError`` whose message is safe to show the client (the route turns it into a
400 envelope).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

#: Accepted containers, as the OpenAI API lists them.
FORMATS = ("mpeg", "wav", "ogg", "aac", "flac", "webm", "mp4")
MIN_SECONDS = 1.0
MAX_SECONDS = 30.0
#: Peak amplitude below which a sample counts as silent (about -60 dBFS).
SILENCE_PEAK = 1e-3


def sniff_format(data: bytes) -> str | None:
    """The container of ``data`` from its magic bytes, or None when it is none we accept."""
    head = data[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head[:4] == b"ADIF":
        return "aac"
    if head[:3] == b"ID3":
        return "mpeg"  # ID3 also fronts some AAC/FLAC files; FFmpeg's probe sorts that out
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        layer = (head[1] >> 1) & 0x3
        if layer == 0 and head[1] & 0xF0 == 0xF0:
            return "aac"  # ADTS: 12-bit sync, layer 00
        if layer != 0:
            return "mpeg"  # MPEG audio frame sync, layer I/II/III
    return None


@dataclass(frozen=True)
class DecodedAudio:
    format: str
    duration_s: float
    pcm_16k: np.ndarray
    """float32 mono 16 kHz (speech tokens, speaker embedding)."""
    pcm_24k: np.ndarray
    """float32 mono 24 kHz (prompt mel)."""


def decode_to_mono(data: bytes, rate: int, max_seconds: float = MAX_SECONDS) -> np.ndarray:
    """All audio of ``data`` as float32 mono at ``rate`` Hz; stops reading past ``max_seconds`` + 1."""
    import av  # imported here: the rest of the module is pure

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise ValueError("The audio file could not be decoded.") from exc
    pieces: list[np.ndarray] = []
    total = 0
    limit = int((max_seconds + 1.0) * rate)
    try:
        streams = container.streams.audio
        if not streams:
            raise ValueError("The file contains no audio stream.")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        for frame in container.decode(streams[0]):
            for out in resampler.resample(frame):
                chunk = out.to_ndarray().reshape(-1).astype(np.float32, copy=False)
                pieces.append(chunk)
                total += chunk.size
            if total > limit:
                break
        else:
            for out in resampler.resample(None):
                pieces.append(out.to_ndarray().reshape(-1).astype(np.float32, copy=False))
    except av.error.FFmpegError as exc:
        raise ValueError("The audio file could not be decoded.") from exc
    finally:
        container.close()
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def decode_upload(data: bytes, *, min_seconds: float = MIN_SECONDS, max_seconds: float = MAX_SECONDS) -> DecodedAudio:
    """Sniff, decode and check an uploaded voice sample (format, duration, not silent)."""
    fmt = sniff_format(data)
    if fmt is None:
        raise ValueError(f"Unsupported audio: the file is none of {', '.join(FORMATS)}.")
    pcm_16k = decode_to_mono(data, 16000, max_seconds)
    duration = pcm_16k.size / 16000
    if duration < min_seconds or duration > max_seconds:
        raise ValueError(f"The audio sample must be {min_seconds:g}-{max_seconds:g} s long; it is {duration:.2f} s.")
    if not np.isfinite(pcm_16k).all() or float(np.max(np.abs(pcm_16k))) < SILENCE_PEAK:
        raise ValueError("The audio sample is silent.")
    pcm_24k = decode_to_mono(data, 24000, max_seconds)
    return DecodedAudio(format=fmt, duration_s=duration, pcm_16k=pcm_16k, pcm_24k=pcm_24k)
