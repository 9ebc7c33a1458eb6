"""Incremental audio encoders: float32 PCM chunks in, bytes of one growing file out.

``make_encoder(fmt)`` returns an ``AudioEncoder``; ``encode(chunk)`` returns the bytes that are ready
now and ``flush()`` the rest at the end. Concatenating every returned byte string gives one valid file.
The first ``encode`` call already returns bytes, so the first audio leaves with the first chunk:
wav/flac/opus write their header at once; raw mp3 and ADTS aac have no header and return their first
frames once the chunk covers the codec's look-ahead (measured: 1 728 samples = 72 ms for mp3, 2 304 =
96 ms for aac; token2wav's first chunk is 0.44 s).

The codecs (mp3, opus, aac, flac) are PyAV ``CodecContext``s used without a muxer: the few bytes of
container framing are written here (ADTS headers, the FLAC stream header, Ogg pages), because FFmpeg's
muxers buffer output in AVIO and Ogg pages, which would hold audio back. WAV and raw PCM need no codec,
and PyAV is imported only when a codec encoder is made: the app then runs without it for pcm and wav
(the GPU benchmark machine has no PyAV, and its carry limit has no room for FFmpeg).

Encoding is CPU work: ``gateway.app`` runs ``encode``/``flush`` of the codec formats in a thread.
"""

from __future__ import annotations

import struct
import zlib
from abc import ABC, abstractmethod
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import av

#: response_format → Content-Type, exactly as OpenAI sends them.
CONTENT_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
FORMATS = tuple(CONTENT_TYPES)

# Bit rates for 24 kHz mono speech.
MP3_BIT_RATE = 64_000
AAC_BIT_RATE = 64_000
OPUS_BIT_RATE = 48_000


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] → int16, clipping overs (the vocoder may overshoot slightly)."""
    return np.round(_as_mono_float32(pcm) * 32767.0).astype("<i2")


def _as_mono_float32(pcm: np.ndarray) -> np.ndarray:
    """Flat float32 in [-1, 1]; a NaN from a misbehaving model becomes silence, not codec garbage."""
    samples = np.asarray(pcm, dtype=np.float32).reshape(-1)
    return np.clip(np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)


class AudioEncoder(ABC):
    """One response's encoder. Not thread-safe: call ``encode``/``flush`` one at a time, in order."""

    content_type: str
    uses_codec: bool = False
    """True when encoding costs real CPU (worth running off the event loop)."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    @abstractmethod
    def encode(self, pcm: np.ndarray) -> bytes:
        """Encode one float32 mono chunk; return the bytes ready now (possibly b"")."""

    @abstractmethod
    def flush(self) -> bytes:
        """End the stream; return whatever was still buffered. No ``encode`` after this."""


class PcmEncoder(AudioEncoder):
    """Raw signed 16-bit little-endian samples, no header."""

    content_type = CONTENT_TYPES["pcm"]

    def encode(self, pcm: np.ndarray) -> bytes:
        return float_to_int16(pcm).tobytes()

    def flush(self) -> bytes:
        return b""


class WavEncoder(AudioEncoder):
    """The canonical 44-byte WAV header, then s16le samples.

    The length is unknown while streaming, so the RIFF and data sizes are 0xFFFFFFFF (what OpenAI
    sends); ordinary decoders read such a file to its end.
    """

    content_type = CONTENT_TYPES["wav"]
    UNKNOWN_SIZE = 0xFFFFFFFF

    def __init__(self, sample_rate: int) -> None:
        super().__init__(sample_rate)
        self._header_sent = False

    def header(self) -> bytes:
        channels, bits = 1, 16
        block_align = channels * bits // 8
        return (
            b"RIFF"
            + struct.pack("<I", self.UNKNOWN_SIZE)
            + b"WAVE"
            + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, self.sample_rate, self.sample_rate * block_align, block_align, bits)
            + b"data"
            + struct.pack("<I", self.UNKNOWN_SIZE)
        )

    def _take_header(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return self.header()

    def encode(self, pcm: np.ndarray) -> bytes:
        return self._take_header() + float_to_int16(pcm).tobytes()

    def flush(self) -> bytes:
        return self._take_header()  # an empty response is still a valid (empty) WAV file


class CodecEncoder(AudioEncoder):
    """A PyAV encoder fed whole codec frames from a sample FIFO; subclasses add container framing."""

    uses_codec = True
    codec_name: str
    sample_format: str
    """PyAV sample format the codec is fed: "fltp"/"flt" (float) or "s16"."""
    bit_rate: int | None = None

    def __init__(self, sample_rate: int) -> None:
        super().__init__(sample_rate)
        import av  # here, not at import time: see the module docstring

        self._av = av
        self.codec = av.CodecContext.create(self.codec_name, "w")
        self.codec.sample_rate = sample_rate
        self.codec.layout = "mono"
        self.codec.format = self.sample_format
        self.codec.time_base = Fraction(1, sample_rate)
        if self.bit_rate:
            self.codec.bit_rate = self.bit_rate
        self.configure(self.codec)
        self.codec.open()
        self.frame_size = self.codec.frame_size or 1024
        self._pending = np.zeros(0, dtype=np.float32)
        self._samples_in = 0
        self._started = False
        self._flushed = False

    def configure(self, codec: av.CodecContext) -> None:
        """Hook for codec options, before ``open``."""

    def stream_header(self) -> bytes:
        """Bytes that start the file (before any packet)."""
        return b""

    @abstractmethod
    def frame_packets(self, packets: list[av.Packet], final: bool) -> bytes:
        """Wrap the codec's packets in the container framing."""

    def _make_frame(self, samples: np.ndarray) -> av.AudioFrame:
        audio_frame = self._av.AudioFrame
        if self.sample_format == "s16":
            frame = audio_frame.from_ndarray(float_to_int16(samples).reshape(1, -1), format="s16", layout="mono")
        else:
            frame = audio_frame.from_ndarray(samples.reshape(1, -1), format=self.sample_format, layout="mono")
        frame.sample_rate = self.sample_rate
        frame.time_base = Fraction(1, self.sample_rate)
        frame.pts = self._samples_in
        self._samples_in += samples.shape[0]
        return frame

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        return self.stream_header()

    def encode(self, pcm: np.ndarray) -> bytes:
        head = self._start()
        samples = _as_mono_float32(pcm)
        self._pending = np.concatenate([self._pending, samples]) if self._pending.size else samples
        packets: list[av.Packet] = []
        whole = (self._pending.shape[0] // self.frame_size) * self.frame_size
        for start in range(0, whole, self.frame_size):
            packets.extend(self.codec.encode(self._make_frame(self._pending[start : start + self.frame_size])))
        self._pending = self._pending[whole:]
        return head + (self.frame_packets(packets, final=False) if packets else b"")

    def flush(self) -> bytes:
        if self._flushed:
            return b""
        self._flushed = True
        head = self._start()
        packets: list[av.Packet] = []
        if self._pending.size:
            # The last frame may be short (SMALL_LAST_FRAME codecs) or is padded with silence.
            last = self._pending
            if not self._accepts_short_last_frame():
                last = np.concatenate([last, np.zeros(self.frame_size - last.shape[0], dtype=np.float32)])
            packets.extend(self.codec.encode(self._make_frame(last)))
            self._pending = np.zeros(0, dtype=np.float32)
        packets.extend(self.codec.encode(None))
        return head + self.frame_packets(packets, final=True)

    def _accepts_short_last_frame(self) -> bool:
        return True


class Mp3Encoder(CodecEncoder):
    """MPEG-1/2 Layer III via LAME: a bare frame stream (each frame carries its own header)."""

    content_type = CONTENT_TYPES["mp3"]
    codec_name = "libmp3lame"
    sample_format = "fltp"
    bit_rate = MP3_BIT_RATE

    def frame_packets(self, packets: list[av.Packet], final: bool) -> bytes:
        return b"".join(bytes(packet) for packet in packets)


class AacEncoder(CodecEncoder):
    """AAC-LC in ADTS: every raw AAC frame gets a 7-byte ADTS header, so the stream needs no index."""

    content_type = CONTENT_TYPES["aac"]
    codec_name = "aac"
    sample_format = "fltp"
    bit_rate = AAC_BIT_RATE
    #: ADTS sampling_frequency_index table (ISO 14496-3).
    FREQUENCY_INDEX = {96000: 0, 88200: 1, 64000: 2, 48000: 3, 44100: 4, 32000: 5, 24000: 6,
                       22050: 7, 16000: 8, 12000: 9, 11025: 10, 8000: 11, 7350: 12}

    def configure(self, codec: av.CodecContext) -> None:
        codec.profile = "LC"

    def adts_header(self, payload_size: int) -> bytes:
        frame_length = payload_size + 7
        profile = 1  # AAC-LC (object type 2) minus one
        frequency_index = self.FREQUENCY_INDEX[self.sample_rate]
        channels = 1
        return bytes(
            [
                0xFF,
                0xF1,  # sync word, MPEG-4, layer 0, no CRC
                (profile << 6) | (frequency_index << 2) | (channels >> 2),
                ((channels & 0x3) << 6) | (frame_length >> 11),
                (frame_length >> 3) & 0xFF,
                ((frame_length & 0x7) << 5) | 0x1F,  # buffer fullness 0x7FF: variable bit rate
                0xFC,
            ]
        )

    def frame_packets(self, packets: list[av.Packet], final: bool) -> bytes:
        out = bytearray()
        for packet in packets:
            payload = bytes(packet)
            out += self.adts_header(len(payload)) + payload
        return bytes(out)

    def _accepts_short_last_frame(self) -> bool:
        return False


class FlacEncoder(CodecEncoder):
    """Native FLAC: ``fLaC`` + STREAMINFO (total length unknown, as in any streamed FLAC), then frames."""

    content_type = CONTENT_TYPES["flac"]
    codec_name = "flac"
    sample_format = "s16"

    def stream_header(self) -> bytes:
        streaminfo = bytes(self.codec.extradata or b"")
        if len(streaminfo) != 34:
            raise RuntimeError(f"FLAC encoder gave {len(streaminfo)} bytes of STREAMINFO, expected 34")
        last_block_streaminfo = bytes([0x80]) + len(streaminfo).to_bytes(3, "big")
        return b"fLaC" + last_block_streaminfo + streaminfo

    def frame_packets(self, packets: list[av.Packet], final: bool) -> bytes:
        return b"".join(bytes(packet) for packet in packets)


class OggPager:
    """Writes Ogg pages (RFC 3533) for one logical stream: each call to ``page`` is one whole page.

    Packets are never split across pages (an Opus packet is at most a few KiB, far below the 255
    lacing segments of one page), which keeps the granule-position bookkeeping trivial.
    """

    MAX_SEGMENTS = 255

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.sequence = 0

    def page(self, packets: list[bytes], granule: int, *, first: bool = False, last: bool = False) -> bytes:
        lacing = bytearray()
        for packet in packets:
            full, rest = divmod(len(packet), 255)
            lacing += b"\xff" * full + bytes([rest])
        if len(lacing) > self.MAX_SEGMENTS:
            raise ValueError("too many packets for one Ogg page")
        header_type = (0x02 if first else 0) | (0x04 if last else 0)
        header = (
            b"OggS"
            + bytes([0, header_type])
            + struct.pack("<qIII", granule, self.serial, self.sequence, 0)
            + bytes([len(lacing)])
            + bytes(lacing)
        )
        self.sequence += 1
        page = bytearray(header + b"".join(packets))
        struct.pack_into("<I", page, 22, ogg_crc32(bytes(page)))
        return bytes(page)

    def pages(self, packets: list[bytes], granules: list[int], *, last: bool) -> bytes:
        """Pack packets into as few pages as fit; ``granules[i]`` is the granule after packet i."""
        out = bytearray()
        batch: list[bytes] = []
        segments = 0
        for index, packet in enumerate(packets):
            needed = len(packet) // 255 + 1
            if batch and segments + needed > self.MAX_SEGMENTS:
                out += self.page(batch, granules[index - 1])
                batch, segments = [], 0
            batch.append(packet)
            segments += needed
        if batch or last:
            out += self.page(batch, granules[-1] if granules else 0, last=last)
        return bytes(out)


# Ogg's CRC is CRC-32 with polynomial 0x04C11DB7, MSB first, initial value 0 and no final xor.
# zlib computes the bit-reflected variant in C; feeding it bit-reversed bytes and bit-reversing the
# result gives Ogg's CRC without a per-byte Python loop.
_REVERSE_BITS = bytes(int(f"{value:08b}"[::-1], 2) for value in range(256))


def ogg_crc32(data: bytes) -> int:
    reflected = zlib.crc32(data.translate(_REVERSE_BITS), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


class OpusEncoder(CodecEncoder):
    """Opus in Ogg (RFC 7845), as OpenAI's ``opus`` format.

    libopus takes 24 kHz input natively (the OpusHead records 24000 as the input rate), so no
    resampling is needed; granule positions are counted at 48 kHz as the spec requires.
    """

    content_type = CONTENT_TYPES["opus"]
    codec_name = "libopus"
    sample_format = "flt"
    bit_rate = OPUS_BIT_RATE
    GRANULE_RATE = 48_000
    VENDOR = b"cosyvoice-speech-api"

    def __init__(self, sample_rate: int) -> None:
        super().__init__(sample_rate)
        head = bytes(self.codec.extradata or b"")
        if not head.startswith(b"OpusHead") or len(head) < 19:
            raise RuntimeError("libopus did not provide an OpusHead")
        self.opus_head = head
        self.pre_skip = struct.unpack_from("<H", head, 10)[0]
        self.granule_per_sample = self.GRANULE_RATE // sample_rate
        self.granule = 0  # samples (48 kHz) decoded so far, pre-skip included (RFC 7845)
        self.input_samples = 0  # at the input rate, before padding to whole frames
        self.pager = OggPager(serial=int.from_bytes(np.random.default_rng().bytes(4), "little"))

    def configure(self, codec: av.CodecContext) -> None:
        codec.options = {"application": "audio"}

    def stream_header(self) -> bytes:
        tags = b"OpusTags" + struct.pack("<I", len(self.VENDOR)) + self.VENDOR + struct.pack("<I", 0)
        return self.pager.page([self.opus_head], 0, first=True) + self.pager.page([tags], 0)

    def frame_packets(self, packets: list[av.Packet], final: bool) -> bytes:
        payloads, granules = [], []
        for packet in packets:
            self.granule += (packet.duration or self.frame_size) * self.granule_per_sample
            payloads.append(bytes(packet))
            granules.append(self.granule)
        if final and granules:
            # The last granule marks where the real audio ends: decoders drop the padding after it.
            granules[-1] = self.pre_skip + self.input_samples * self.granule_per_sample
        if not payloads and not final:
            return b""
        return self.pager.pages(payloads, granules, last=final)

    def encode(self, pcm: np.ndarray) -> bytes:
        self.input_samples += np.asarray(pcm).size
        return super().encode(pcm)

    def _accepts_short_last_frame(self) -> bool:
        return False


_ENCODERS: dict[str, type[AudioEncoder]] = {
    "mp3": Mp3Encoder,
    "opus": OpusEncoder,
    "aac": AacEncoder,
    "flac": FlacEncoder,
    "wav": WavEncoder,
    "pcm": PcmEncoder,
}


def make_encoder(fmt: str, sample_rate: int = 24_000) -> AudioEncoder:
    """A fresh encoder for one response in ``fmt`` (one of ``FORMATS``)."""
    try:
        encoder_class = _ENCODERS[fmt]
    except KeyError:
        raise ValueError(f"unknown audio format {fmt!r}; known: {', '.join(FORMATS)}") from None
    return encoder_class(sample_rate)
