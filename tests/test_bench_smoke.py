"""The benchmark harness end to end on the shared local stack (tiny models, CPU): each subcommand runs,
writes a parseable results.json with every request successful, and plots a PNG. No timing assertions
beyond hang deadlines: the numbers on this machine are regression markers, not targets.

- ``http``: the gateway (over the stack's vLLM) with the OpenAI SDK at concurrency 1,2;
- ``token2wav``: the stack's Triton directly, 40 tokens per request, concurrency 1,2;
- ``pipeline``: SpeechPipeline in-process over the LLM replayer (a subprocess) and the stack's Triton;
- ``plot``: the three results in one PNG.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backends.llm.vllm_launcher import free_port
from tests.support.stack_fixture import stack  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[1]
RUN_DEADLINE_S = 600
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TEXTS = ["Hello there.", "Good morning to you.", "One two three four."]


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "backends.bench", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=RUN_DEADLINE_S, env={**os.environ, **(env or {})})
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    return result


def check_results(out: Path, mode: str, levels: list[int], requests: int, seconds_per_token: bool) -> dict:
    results = json.loads((out / "results.json").read_text())
    assert results["mode"] == mode
    assert results["host"]["python"] and results["host"]["cpu_model"]
    assert [level["summary"]["concurrency"] for level in results["levels"]] == levels
    for level in results["levels"]:
        summary = level["summary"]
        assert (summary["n"], summary["errors"]) == (requests, 0), summary
        assert len(level["requests"]) == requests
        for record in level["requests"]:
            assert record["error"] is None
            assert 0 < record["ttfa_s"] <= record["total_s"]
            assert record["audio_s"] > 0 and record["rtf"] > 0
            assert record["underruns"] >= 0
            if seconds_per_token:  # 25 tokens per second of audio
                assert record["tokens"] > 0
                assert record["audio_s"] == pytest.approx(record["tokens"] * 0.04, rel=0.05, abs=0.05), record
        assert summary["ttfa_p50_ms"] > 0 and summary["rtf_mean"] > 0
        assert summary["bench_cpu_pct"] > 0  # the client did some work
    assert (out / "ttfa.png").read_bytes()[:8] == PNG_SIGNATURE
    return results


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def test_http_bench_against_the_gateway(stack, texts_file: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "http"
    result = bench("http", "--url", stack.url + "/v1", "--concurrency", "1,2", "--requests", "3",
                   "--texts", str(texts_file), "--response-format", "pcm", "--voice", "alloy", "--out", str(out))
    assert "ttfa p50" in result.stdout
    results = check_results(out, "http", [1, 2], 3, seconds_per_token=False)
    # pcm s16le: audio seconds are bytes / 48000, so every record's audio is a whole number of samples
    for record in results["levels"][0]["requests"]:
        assert abs(record["audio_s"] * 24000 - round(record["audio_s"] * 24000)) < 1e-3


def test_token2wav_bench_against_triton(stack, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "t2w"
    bench("token2wav", "--triton", stack.env["TTS_TRITON_URL"], "--voices-dir", stack.env["TTS_VOICES_DIR"],
          "--voice", "alloy", "--tokens", "40", "--prefill-ms", "20", "--token-ms", "5", "--concurrency", "1,2",
          "--requests", "3", "--out", str(out))
    results = check_results(out, "token2wav", [1, 2], 3, seconds_per_token=True)
    for level in results["levels"]:
        assert level["summary"]["first_chunk_p50_ms"] > 0
        for record in level["requests"]:
            assert record["tokens"] == 40 and 0 < record["first_chunk_s"] < record["total_s"]


@pytest.fixture()
def replayer_url():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "backends.llm.replayer", "--port", str(port), "--prefill-ms", "20", "--token-ms", "5",
         "--tokens-per-text-token", "12", "--model", "cosyvoice2"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            assert proc.poll() is None, "the replayer exited"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(root + "/health", timeout=1.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the replayer did not start"
            time.sleep(0.1)
        yield root + "/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_pipeline_bench_over_the_replayer(stack, replayer_url: str, texts_file: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "pipeline"
    bench("pipeline", "--llm-url", replayer_url, "--llm-model", "cosyvoice2", "--triton", stack.env["TTS_TRITON_URL"],
          "--voices-dir", stack.env["TTS_VOICES_DIR"], "--tokenizer-dir", stack.env["TTS_LLM_TOKENIZER_DIR"],
          "--texts", str(texts_file), "--concurrency", "1", "--requests", "2", "--out", str(out))
    results = check_results(out, "pipeline", [1], 2, seconds_per_token=True)
    record = results["levels"][0]["requests"][0]
    assert 0 < record["llm_first_token_s"] <= record["ttfa_s"] and record["first_chunk_s"] > 0
    # the replayer's length rule: 12 speech tokens per text token (the texts are far below max_tokens)
    assert record["tokens"] % 12 == 0

    plot = tmp_path / "compare.png"
    result = bench("plot", str(out / "results.json"), str(out / "results.json"), "--labels", "a,b", "--out", str(plot))
    assert "conc" in result.stdout
    assert plot.read_bytes()[:8] == PNG_SIGNATURE
