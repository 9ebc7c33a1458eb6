"""The voice encoder: a prompt recording → one ``Voice`` (a CosyVoice spk2info entry).

Where it runs: in the gateway process, on a worker thread (``asyncio.to_thread`` behind a
semaphore in ``gateway.routes_voices``). Voice creation is rare and one-off (seconds of audio,
about a second of CPU), needs only onnxruntime + numpy (no torch, so the gateway stays
torch-free), and the result must land in the gateway's own voice store anyway; a Triton model
would add a model, a config and a gRPC round trip of raw audio for no throughput gain. The
price: each replica that accepts uploads loads the two ONNX files (the tokenizer is the large
one); replicas with ``voice_encoder_dir`` empty answer voice creation with 503.

Pipeline (ARCHITECTURE.md "Voice"): 16 kHz audio → whisper log-mel (128) → ``speech_tokenizer_v2_25hz.onnx``
→ S3 tokens; 16 kHz → Kaldi fbank (80, dither 0) minus its time mean → ``campplus.onnx`` →
192-d embedding; 24 kHz → prompt mel; tokens and mel trimmed so mel frames = 2 × tokens.
ONNX inputs and outputs are used by position, as the upstream frontend does.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.voices.features import kaldi_fbank, prompt_mel, whisper_log_mel

TOKENIZER_FILE = "speech_tokenizer_v2_25hz.onnx"
CAMPPLUS_FILE = "campplus.onnx"
MAX_TOKEN_ID = 6560


@dataclass(frozen=True)
class EncodedPrompt:
    prompt_tokens: np.ndarray
    """int32 [T]"""
    prompt_mel: np.ndarray
    """float32 [2T, 80]"""
    speaker_embedding: np.ndarray
    """float32 [192]"""
    model_hash: str


def model_files_hash(model_dir: str | Path) -> str:
    """sha256 over both ONNX files (names and bytes): recorded in every voice made with them."""
    h = hashlib.sha256()
    for name in (TOKENIZER_FILE, CAMPPLUS_FILE):
        h.update(name.encode())
        with open(Path(model_dir) / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


class VoiceEncoder:
    """Holds the two onnxruntime sessions; ``encode`` is thread-safe (onnxruntime's ``run`` is)."""

    def __init__(self, model_dir: str | Path, intra_op_threads: int = 1) -> None:
        import onnxruntime as ort  # imported here so importing this module (features, constants) is cheap

        self.model_dir = Path(model_dir)
        for name in (TOKENIZER_FILE, CAMPPLUS_FILE):
            if not (self.model_dir / name).is_file():
                raise FileNotFoundError(f"voice encoder model {self.model_dir / name} is missing")
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        providers = ["CPUExecutionProvider"]
        self._tokenizer = ort.InferenceSession(str(self.model_dir / TOKENIZER_FILE), options, providers=providers)
        self._campplus = ort.InferenceSession(str(self.model_dir / CAMPPLUS_FILE), options, providers=providers)
        self.model_hash = model_files_hash(self.model_dir)
        self._lock = threading.Lock()  # one encode at a time per session pair keeps CPU use predictable

    def speech_tokens(self, audio_16k: np.ndarray) -> np.ndarray:
        feats = whisper_log_mel(audio_16k)[None]  # [1, 128, T]
        inputs = self._tokenizer.get_inputs()
        out = self._tokenizer.run(
            None, {inputs[0].name: feats, inputs[1].name: np.array([feats.shape[2]], np.int32)}
        )[0]
        tokens = np.asarray(out).reshape(-1).astype(np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() > MAX_TOKEN_ID):
            raise RuntimeError("the speech tokenizer returned ids outside 0..6560")
        return tokens.astype(np.int32)

    def speaker_embedding(self, audio_16k: np.ndarray) -> np.ndarray:
        feats = kaldi_fbank(audio_16k)
        feats = feats - feats.mean(axis=0, keepdims=True)
        inputs = self._campplus.get_inputs()
        out = self._campplus.run(None, {inputs[0].name: feats[None].astype(np.float32)})[0]
        emb = np.asarray(out, np.float32).reshape(-1)
        if emb.shape != (192,):
            raise RuntimeError(f"campplus returned shape {np.asarray(out).shape}, expected [1, 192]")
        return emb

    def encode(self, audio_16k: np.ndarray, audio_24k: np.ndarray) -> EncodedPrompt:
        """Blocking: call from a worker thread."""
        with self._lock:
            tokens = self.speech_tokens(audio_16k)
            embedding = self.speaker_embedding(audio_16k)
        mel = prompt_mel(audio_24k)
        token_len = min(mel.shape[0] // 2, tokens.size)
        if token_len == 0:
            raise ValueError("The audio sample is too short to encode.")
        return EncodedPrompt(
            prompt_tokens=tokens[:token_len],
            prompt_mel=np.ascontiguousarray(mel[: 2 * token_len]),
            speaker_embedding=embedding,
            model_hash=self.model_hash,
        )
