"""One typed settings object, read from the environment (prefix ``TTS_``).

Every field is documented in the README's configuration table; defaults fit the local stack
(``make run``), where the LLM server, Triton and the gateway share one machine.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TTS_", extra="ignore")

    # --- HTTP ---
    host: str = "127.0.0.1"
    port: int = 8000
    served_model: str = "cosyvoice2-dit"
    """Our own model id; the OpenAI names (tts-1, tts-1-hd, gpt-4o-mini-tts, ...) are aliases of it."""
    max_body_bytes: int = 1_048_576
    """Largest JSON body accepted on /v1/audio/speech (413 beyond it)."""
    max_upload_bytes: int = 12_582_912
    """Largest multipart body on /v1/audio/voices and /v1/audio/voice_consents (10 MiB audio + form)."""
    model_aliases: list[str] = [
        "tts-1",
        "tts-1-hd",
        "tts-1-1106",
        "tts-1-hd-1106",
        "gpt-4o-mini-tts",
        "gpt-4o-mini-tts-2025-03-20",
        "gpt-4o-mini-tts-2025-12-15",
    ]
    """OpenAI model names accepted as aliases of ``served_model`` (JSON list in the environment)."""

    # --- speech-token LLM server (trtllm-serve in production, vLLM elsewhere) ---
    llm_url: str = "http://127.0.0.1:8100/v1"
    llm_model: str = "cosyvoice2"
    llm_dialect: Literal["auto", "trtllm", "vllm", "openai"] = "auto"
    llm_tokenizer_dir: str = "var/models/llm"
    """Folder with the LLM's tokenizer files (tokenizer.json ...): prompts are sent as token ids."""
    llm_context_tokens: int = 2048
    llm_timeout_s: float = 60.0
    llm_temperature: float = 0.8
    llm_top_p: float = 0.95
    llm_top_k: int = 50
    llm_repetition_penalty: float = 1.1
    llm_send_min_tokens: bool = True
    """Send ``min_tokens`` (CosyVoice's lower length bound); false for a server that rejects the field
    (older trtllm-serve 1.x): eos then ends generation wherever the model emits it."""

    # --- token2wav on Triton ---
    triton_url: str = "127.0.0.1:8201"
    """gRPC address of tritonserver."""
    triton_model: str = "token2wav_dit"
    triton_timeout_s: float = 60.0

    # --- endpoint pools (gateway/pools.py) ---
    llm_urls: list[str] = []
    """LLM servers to spread utterances over (JSON list); empty: the one ``llm_url``."""
    triton_urls: list[str] = []
    """token2wav Tritons (gRPC addresses, JSON list); empty: the one ``triton_url``."""
    pool_health_interval_s: float = 2.0
    """Seconds between background health probes of every endpoint (0: probe only at start)."""
    pool_probe_timeout_s: float = 2.0
    """A probe slower than this counts as a failure."""

    # --- streaming ---
    chunk_schedule: str = "exponential100"
    """Named token-chunk schedule (see gateway/pipeline.py)."""

    # --- text ---
    text_normalization: bool = True
    """Read numbers, dates, times, currencies, units and symbols as words (gateway/normalize.py) unless
    a request sends ``"normalize": false``; false turns it off for requests that do not ask for it."""

    # --- voices ---
    voices_dir: str = "var/voices"
    voice_store: Literal["local", "redis"] = "local"
    """Where custom voices and consents live: a directory, or Redis (shared by several gateways)."""
    voice_store_dir: str = ""
    """The local store's directory; empty means ``<voices_dir>/custom``."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "tts:"
    voice_cache_size: int = 256
    """Decoded custom voices kept in memory per gateway (LRU)."""
    voice_encoder_dir: str = ""
    """Folder with ``speech_tokenizer_v2_25hz.onnx`` and ``campplus.onnx``; empty disables voice creation (503)."""
    voice_encoder_threads: int = 1
    """Concurrent voice encodings per gateway (each runs in a worker thread)."""

    # --- reliability and operations (issue 7; see gateway/admission.py, gateway/auth.py) ---
    max_concurrent_streams: int = 32
    """Speech streams in flight gateway-wide; one more is a 429 with Retry-After (0 = no limit)."""
    max_streams_per_key: int = 8
    """Speech streams in flight per API key (only when auth is on; 0 = no limit)."""
    admission_retry_after_s: float = 1.0
    """Retry-After sent with admission 429s and token2wav capacity 429s."""
    request_timeout_s: float = 1800.0
    """Longest one speech request may take, first byte to last (0 = no limit). A 4096-character
    input is up to ~15 min of audio, and a client that reads at playback speed takes that long:
    30 min leaves room for it; hangs are caught by the idle timeout."""
    stream_idle_timeout_s: float = 120.0
    """Longest wait for the next audio chunk, including the first (0 = no limit)."""
    api_keys: SecretStr = SecretStr("")
    """Comma-separated API keys; auth is off when neither this nor ``api_keys_file`` gives a key."""
    api_keys_file: str = ""
    """File with one API key per line (blank lines and ``#`` comments ignored)."""
    metrics_require_auth: bool = False
    """Whether GET /metrics needs an API key (when auth is on)."""
    shutdown_drain_s: float = 30.0
    """On shutdown, how long the app waits for in-flight streams to finish before closing the backends."""

    # --- logs (gateway/logs.py) ---
    log_format: Literal["json", "text"] = "json"
    """``json``: one JSON object per line (time, level, logger, message, request_id, exception), for log
    pipelines; ``text``: one readable line per record. Applies to uvicorn's own records too."""
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    """Least severe level written (uvicorn's own loggers keep its ``--log-level``)."""

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _lowercase(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    def llm_endpoints(self) -> list[str]:
        return list(self.llm_urls) or [self.llm_url]

    def triton_endpoints(self) -> list[str]:
        return list(self.triton_urls) or [self.triton_url]


@lru_cache
def get_settings() -> Settings:
    return Settings()
