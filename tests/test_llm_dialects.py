"""Dialect request bodies, dialect detection and the `<|s_N|>` text fallback (no server needed)."""

from __future__ import annotations

from gateway.llm import vocab
from gateway.llm.dialects import (
    ChunkDecoder,
    SamplingParams,
    SpeechTokenTextParser,
    dialect_from_models,
    request_body,
)
from gateway.llm.prompt import LLMPrompt
from tests.support.trtllm_peer import PeerCompletionRequest

PROMPT = LLMPrompt(token_ids=[158227, 104, 105, 158228], text_token_count=2, max_tokens=40, min_tokens=4, mode="x")


def test_trtllm_body_uses_only_fields_trtllm_serve_knows() -> None:
    body = request_body("trtllm", "cosyvoice2", PROMPT, SamplingParams())
    assert set(body) <= set(PeerCompletionRequest.model_fields)
    assert body["detokenize"] is False and "return_token_ids" not in body
    assert body["prompt"] == PROMPT.token_ids
    assert body["stop_token_ids"] == [158224, 158225, 158226]
    assert (body["temperature"], body["top_p"], body["top_k"], body["repetition_penalty"]) == (0.8, 0.95, 50, 1.1)
    assert (body["max_tokens"], body["min_tokens"], body["stream"]) == (40, 4, True)
    PeerCompletionRequest(**body)  # the strict schema accepts it


def test_vllm_body_asks_for_token_ids() -> None:
    body = request_body("vllm", "m", PROMPT, SamplingParams(temperature=0.5))
    assert body["return_token_ids"] is True and "detokenize" not in body
    assert body["temperature"] == 0.5 and body["min_tokens"] == 4
    assert "min_tokens" not in request_body("vllm", "m", PROMPT, SamplingParams(), send_min_tokens=False)


def test_openai_body_is_standard_only() -> None:
    body = request_body("openai", "m", PROMPT, SamplingParams())
    assert set(body) == {"model", "prompt", "max_tokens", "temperature", "top_p", "stream", "stop"}
    assert body["stop"] == ["<|eos1|>", "<|eos2|>", "<|eos3|>"]


def test_dialect_detection_from_models_owner() -> None:
    assert dialect_from_models({"data": [{"id": "a", "owned_by": "vllm"}]}) == "vllm"
    assert dialect_from_models({"data": [{"id": "a", "owned_by": "tensorrt_llm"}]}) == "trtllm"
    assert dialect_from_models({"data": [{"id": "a", "owned_by": "someone"}]}) == "openai"
    assert dialect_from_models({}) == "openai"


STREAM_TEXT = "<|s_0|><|s_123|>junk<|s_6560|> <|s_77|><|eos1|><|s_5|>"
EXPECTED_IDS = [151663, 151663 + 123, 151663 + 6560, 151663 + 77, vocab.EOS1_ID, 151663 + 5]


def test_text_parser_whole_text() -> None:
    assert SpeechTokenTextParser().feed(STREAM_TEXT) == EXPECTED_IDS


def test_text_parser_every_two_way_split() -> None:
    for cut in range(len(STREAM_TEXT) + 1):
        parser = SpeechTokenTextParser()
        got = parser.feed(STREAM_TEXT[:cut]) + parser.feed(STREAM_TEXT[cut:])
        assert got == EXPECTED_IDS, cut


def test_text_parser_one_character_at_a_time() -> None:
    parser = SpeechTokenTextParser()
    got: list[int] = []
    for ch in STREAM_TEXT:
        got += parser.feed(ch)
    assert got == EXPECTED_IDS


def test_text_parser_ignores_out_of_range_and_lookalikes() -> None:
    parser = SpeechTokenTextParser()
    assert parser.feed("<|s_6561|><|s_x|><s_3><|s_4|") == []
    assert parser.feed(">") == [151663 + 4]


def test_chunk_decoder_prefers_token_ids_over_text() -> None:
    decoder = ChunkDecoder()
    assert decoder.feed({"text": "<|s_1|>", "token_ids": [151663 + 9]}) == [151663 + 9]
    assert decoder.feed({"text": "<|s_", "token_ids": None}) == []
    assert decoder.feed({"text": "2|>"}) == [151665]
    assert decoder.feed({"text": ""}) == []
