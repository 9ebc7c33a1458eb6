"""Fast checks of the benchmark harness: the playback-underrun model on hand-made arrivals, the
per-level summary, and the LLM replayer (backends/llm/replayer.py) against our own LLM client."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backends.bench.drivers import byte_arrivals
from backends.bench.metrics import RequestRecord, playback, summarize
from backends.llm.replayer import ReplayerConfig, Timetable, planned_tokens, speech_tokens, text_token_count
from backends.llm.tiny import write_tiny_tokenizer
from backends.llm.vllm_launcher import free_port
from gateway.llm import vocab
from gateway.llm.client import SpeechTokenLLM
from gateway.llm.prompt import CosyVoicePromptBuilder

HANG_DEADLINE_S = 60.0
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ underruns

def test_playback_counts_each_late_chunk_and_shifts_the_clock() -> None:
    # plays 1.0-1.5, then 1.5-2.0; 2.5 arrives 0.5 s after the buffer ran dry -> plays 2.5-3.5;
    # 3.0 is in time (3.5-3.7); 4.0 is 0.3 s late.
    arrivals = [(1.0, 0.5), (1.2, 0.5), (2.5, 1.0), (3.0, 0.2), (4.0, 0.1)]
    result = playback(arrivals)
    assert result.underruns == 2
    assert result.stall_s == pytest.approx(0.8)
    assert result.least_buffered_s == pytest.approx(-0.5)   # the worst: 2.5 came 0.5 s after the buffer ran dry


def test_playback_least_buffered_is_how_near_a_request_came_to_an_underrun() -> None:
    # 1.0 s of audio at 0.0; the next at 0.7 (0.3 s left), then at 1.9 (1.0 + 1.0 - 1.9 = 0.1 s left)
    result = playback([(0.0, 1.0), (0.7, 1.0), (1.9, 1.0)])
    assert result.underruns == 0 and result.least_buffered_s == pytest.approx(0.1)
    assert playback([(0.0, 1.0)]).least_buffered_s is None      # one chunk: nothing to be late


def test_playback_edge_cases() -> None:
    assert playback([]) == playback([(5.0, 0.0)])
    assert playback([]).underruns == 0 and playback([]).stall_s == 0
    # arriving exactly when the buffer ends is not an underrun; empty chunks never are
    assert playback([(0.0, 1.0), (1.0, 1.0), (9.0, 0.0), (2.0, 1.0)]).underruns == 0
    # each stall shifts the playback clock: chunk 2 (2 s late) plays 3-4, so chunk 3 is 0.5 s late
    result = playback([(0.0, 1.0), (3.0, 1.0), (4.5, 1.0)])
    assert result.underruns == 2 and result.stall_s == pytest.approx(2.0 + 0.5)


def test_record_finish_and_summary() -> None:
    ok = RequestRecord(concurrency=2, index=0, worker=0, text_index=0, started_s=0.0,
                       arrivals=[(0.0, 0.0), (0.25, 1.0), (1.0, 1.0), (3.0, 1.0)])
    ok.finish(3.0)
    assert ok.ttfa_s == 0.25 and ok.audio_s == 3.0 and ok.rtf == 1.0
    assert (ok.underruns, ok.stall_s) == (1, pytest.approx(0.75))
    failed = RequestRecord(concurrency=2, index=1, worker=1, text_index=1, started_s=0.1, error="RateLimitError(429)")
    failed.finish(0.01)
    summary = summarize(2, [ok, failed], wall_s=3.0)
    assert (summary["n"], summary["ok"], summary["errors"]) == (2, 1, 1)
    assert summary["errors_by_type"] == {"RateLimitError(429)": 1}
    assert summary["ttfa_p50_ms"] == 250.0 and summary["total_p99_ms"] == 3000.0
    assert summary["underruns"] == 1 and summary["underrun_requests_pct"] == 100.0
    assert summary["throughput_audio_s_per_s"] == 1.0 and summary["first_chunk_p50_ms"] is None
    assert summary["least_buffered_min_ms"] == -750.0     # 3.0 came 0.75 s after 2.25, when the audio ran out
    assert ok.as_dict()["arrivals"][1] == [0.25, 1.0]


def test_byte_arrivals_pcm_and_wav() -> None:
    assert byte_arrivals("pcm", [(0.1, 48000), (0.2, 24000)], None) == [(0.1, 1.0), (0.2, 0.5)]
    # the 44-byte wav header may be split over chunks
    assert byte_arrivals("wav", [(0.1, 40), (0.2, 4 + 48000)], None) == [(0.1, 0.0), (0.2, 1.0)]


# ------------------------------------------------------------------------------------- replayer

def test_timetable_and_lengths() -> None:
    table = Timetable(prefill_s=0.02, token_s=0.005)
    assert table.due(0) == 0.02 and table.due(10) == pytest.approx(0.07)
    assert [table.count_due(t, 100) for t in (0.0, 0.0199, 0.02, 0.0249, 0.025, 10.0)] == [0, 0, 1, 1, 2, 100]
    sos, task, eop = vocab.SOS_ID, vocab.TASK_ID, vocab.ENDOFPROMPT_ID
    speech = [vocab.SPEECH_TOKEN_BASE_ID + 5] * 7
    assert text_token_count([sos, 1, 2, 3, task]) == 3
    assert text_token_count([sos, 9, 9, eop, 1, 2, task]) == 2  # instruct: after <|endofprompt|>
    # zero-shot: transcript (9, 9) + text (1, 2, 3); min_tokens = 2 x text tokens leaves the transcript out
    assert text_token_count([sos, 9, 9, 1, 2, 3, task, *speech], min_tokens=6) == 3
    config = ReplayerConfig(tokens_per_text_token=12)
    assert planned_tokens(config, [sos, 1, 2, 3, task], 6, 60) == 36
    assert planned_tokens(config, [sos, 1, 2, 3, task], 6, 20) == 20  # capped by max_tokens
    assert planned_tokens(ReplayerConfig(tokens=7), [sos, 1, task], 2, 20) == 7
    ids = speech_tokens(0, [sos, 1, task], 50)
    assert (ids == speech_tokens(0, [sos, 1, task], 50)).all()  # same prompt, same tokens
    assert ids.min() >= vocab.SPEECH_TOKEN_BASE_ID and ids.max() < vocab.SPEECH_TOKEN_BASE_ID + 6561


@pytest.fixture(scope="module")
def replayer(tmp_path_factory: pytest.TempPathFactory):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.llm.replayer", "--port", str(port), "--prefill-ms", "5",
         "--token-ms", "10", "--tokens-per-text-token", "12"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HANG_DEADLINE_S
    while True:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "replayer exited"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                break
        assert time.monotonic() < deadline, "replayer did not start"
        time.sleep(0.1)
    tokenizer = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    yield url, CosyVoicePromptBuilder(str(tokenizer))
    proc.terminate()
    proc.wait(timeout=15)


def _gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5.0).text
    return sum(float(line.rsplit(" ", 1)[-1]) for line in text.splitlines() if line.startswith(name + "{"))


async def test_replayer_speaks_vllm_to_our_client(replayer) -> None:
    url, builder = replayer
    prompt = builder.build("Hello there, replayer.")
    async with SpeechTokenLLM(url + "/v1", "cosyvoice2", builder) as llm:
        assert llm.dialect == "vllm"
        tokens = await asyncio.wait_for(_collect(llm.stream(prompt)), HANG_DEADLINE_S)
    expected = planned_tokens(ReplayerConfig(tokens_per_text_token=12), prompt.token_ids, prompt.min_tokens,
                              prompt.max_tokens)
    assert len(tokens) == expected == min(12 * prompt.text_token_count, prompt.max_tokens)
    assert all(0 <= t <= 6560 for t in tokens)
    assert llm.early_eos_count == 0 and llm.stray_token_count == 0
    assert _gauge(url, "vllm:num_requests_running") == 0


async def test_replayer_stops_a_stream_the_client_left(replayer) -> None:
    url, builder = replayer
    prompt = builder.build("A much longer sentence, so that the replayer has hundreds of speech tokens to send.")
    aborted_before = _gauge(url, "replayer_aborted_total")
    async with SpeechTokenLLM(url + "/v1", "cosyvoice2", builder) as llm:
        stream = llm.stream(prompt)
        async with contextlib.aclosing(stream):
            for _ in range(5):
                await asyncio.wait_for(anext(stream), HANG_DEADLINE_S)
            assert await asyncio.to_thread(_gauge, url, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + HANG_DEADLINE_S
    while await asyncio.to_thread(_gauge, url, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the replayer kept streaming to a closed connection"
        await asyncio.sleep(0.05)
    assert await asyncio.to_thread(_gauge, url, "replayer_aborted_total") == aborted_before + 1


async def _collect(stream) -> list[int]:
    return [t async for t in stream]
