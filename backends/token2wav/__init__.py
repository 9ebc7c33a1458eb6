"""Step-Audio2 DiT token2wav: flow (tokens -> mel) + HiFT (mel -> 24 kHz audio), streaming engine.

Public entry points: ``backends.token2wav.engine.Token2WavEngine`` (load / prepare_voice /
start_stream / feed / synthesize), ``backends.token2wav.tiny.write_token2wav_dir`` (random test
weights in the published file formats), ``python -m backends.token2wav`` (offline CLI) and
``python -m backends.token2wav.bench`` (GPU/CPU latency benchmark with random weights).
Submodules are imported lazily so that light users (e.g. the Triton adapter's config parsing)
do not pay for torch at import time.
"""
