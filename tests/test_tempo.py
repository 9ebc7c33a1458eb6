"""Speed changes scale duration by 1/speed and keep the pitch."""

import numpy as np
import pytest

from gateway.tempo import TempoStretcher

SR = 24000


def dominant_frequency(pcm: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(pcm.size)))
    return float(np.fft.rfftfreq(pcm.size, 1 / SR)[spectrum.argmax()])


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.5, 2.0, 4.0])
def test_duration_scales_and_pitch_stays(speed: float) -> None:
    tone = np.sin(2 * np.pi * 220 * np.arange(SR * 3) / SR).astype(np.float32)
    stretcher = TempoStretcher(speed, SR)
    chunks = [stretcher.process(piece) for piece in np.array_split(tone, 17)]
    out = np.concatenate(chunks + [stretcher.flush()])
    assert abs(out.size - tone.size / speed) <= 0.02 * tone.size / speed
    assert abs(dominant_frequency(out) - 220) < 5
