"""The request/response differences between the completion servers we talk to.

All of them speak OpenAI ``/v1/completions`` with a token-id prompt and SSE streaming; they differ in
how generated token ids come back and in what they tolerate:

- ``trtllm`` (trtllm-serve): rejects unknown JSON fields with 400, so the body holds only fields of its
  CompletionRequest; ``detokenize: false`` makes each chunk carry ``token_ids``.
- ``vllm``: ignores unknown fields, validates the model name; ``return_token_ids: true`` makes each
  chunk carry ``token_ids``.
- ``openai`` (fallback for an unrecognised server): standard fields only; speech tokens are parsed out of
  the streamed text, where ``<|s_N|>`` may be split across chunks (``SpeechTokenTextParser``).

Whatever the dialect, a chunk that carries ``token_ids`` is decoded from them and one that does not is
parsed from its text, so a server that ignores the token-id switch still works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.llm import vocab
from gateway.llm.prompt import LLMPrompt

DIALECTS = ("trtllm", "vllm", "openai")


@dataclass(frozen=True)
class SamplingParams:
    """Upstream CosyVoice2 sampling defaults."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 50
    repetition_penalty: float = 1.1


def request_body(
    dialect: str, model: str, prompt: LLMPrompt, sampling: SamplingParams, *, send_min_tokens: bool = True
) -> dict[str, Any]:
    """The JSON body of one streaming completion in ``dialect``. Every key here must exist in the
    server's request schema for that dialect (trtllm-serve answers 400 to anything else)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt.token_ids),
        "max_tokens": prompt.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
    }
    if dialect == "openai":
        # Standard `stop` strings: end on the eos markers where the server shows them in text (where it
        # hides special tokens, only max_tokens ends the stream).
        body["stop"] = list(vocab.TAIL_TOKENS[:3])
        return body
    body.update(
        top_k=sampling.top_k,
        repetition_penalty=sampling.repetition_penalty,
        stop_token_ids=list(vocab.EOS_IDS),
        # keep the s-tokens visible in text even where the server decodes it anyway
        skip_special_tokens=False,
    )
    if send_min_tokens:
        body["min_tokens"] = prompt.min_tokens
    if dialect == "trtllm":
        body["detokenize"] = False
    elif dialect == "vllm":
        body["return_token_ids"] = True
    else:
        raise ValueError(f"unknown dialect {dialect!r}; expected one of {DIALECTS}")
    return body


def dialect_from_models(models_payload: dict[str, Any]) -> str:
    """Recognise the server from its ``/v1/models`` answer: each names its owner in ``owned_by``
    ("vllm" for vLLM, "tensorrt_llm" for trtllm-serve). Anything else gets the text fallback."""
    owners = {str(card.get("owned_by", "")).lower() for card in models_payload.get("data", [])}
    if "vllm" in owners:
        return "vllm"
    if "tensorrt_llm" in owners or "tensorrt-llm" in owners:
        return "trtllm"
    return "openai"


_MARKER = re.compile(r"<\|(s_(\d+)|eos([123]))\|>")
_MARKER_MAX_LEN = len("<|s_6560|>")


class SpeechTokenTextParser:
    """Turns streamed completion text into vocabulary ids of speech and eos markers.

    Text deltas may cut a marker anywhere (``"<|s_1"`` then ``"23|>"``): an unfinished ``<|...`` tail
    is held back until the next delta completes it. Text that is not a marker is dropped.
    """

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> list[int]:
        buffer = self._pending + text
        ids: list[int] = []
        consumed = 0
        for match in _MARKER.finditer(buffer):
            if match.group(2) is not None:
                s = int(match.group(2))
                ids.append(vocab.SPEECH_TOKEN_BASE_ID + s if s < vocab.SPEECH_TOKEN_COUNT else -1)
            else:
                ids.append(vocab.EOS_IDS[int(match.group(3)) - 1])
            consumed = match.end()
        rest = buffer[consumed:]
        start = rest.rfind("<")
        # keep a tail that could still grow into a marker; drop everything else
        if start != -1 and len(rest) - start < _MARKER_MAX_LEN and "|>" not in rest[start:]:
            self._pending = rest[start:]
        else:
            self._pending = ""
        return [i for i in ids if i >= 0]


class ChunkDecoder:
    """Per-stream: vocabulary ids carried by one SSE ``choices[i]`` object (token ids if present, else text)."""

    def __init__(self) -> None:
        self._text = SpeechTokenTextParser()

    def feed(self, choice: dict[str, Any]) -> list[int]:
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            return [int(t) for t in token_ids]
        text = choice.get("text")
        return self._text.feed(text) if text else []
