r"""A speech-token LLM *replayer*: a named stand-in for the CosyVoice2 LLM server in benchmarks.

    python -m backends.llm.replayer --host 127.0.0.1 --port 8100 --prefill-ms 20 --token-ms 5 \
        --tokens-per-text-token 12 --model cosyvoice2

It answers like vLLM's OpenAI server (``GET /v1/models`` with ``owned_by: "vllm"``, so the gateway's
dialect detection picks the vLLM dialect; ``GET /health``; ``POST /v1/completions`` streaming SSE with
``return_token_ids``; ``GET /metrics`` with ``vllm:num_requests_running``) but runs no model: each
request gets random speech token ids (seeded by ``--seed`` and the prompt, so the same prompt always
gets the same tokens) on a fixed timetable, per stream:

    token i is sent at  t0 + prefill_ms + i * token_ms   (t0: the request arrived)
    then the eos id at  t0 + prefill_ms + n * token_ms

Sleeps target those absolute times, so many streams do not drift; tokens whose time has passed when a
stream wakes (the machine is busy) go out together in one event, as vLLM's ``stream_interval`` would.
How late tokens went out is in ``/metrics`` (``replayer_lag_seconds_max``), to check that the replayer
itself is not the bottleneck of a benchmark.

Length: ``n = clamp(tokens_per_text_token x text_tokens, max(min_tokens, 1), max_tokens)``, or a fixed
``--tokens`` (still clamped). ``text_tokens`` is the CosyVoice2 prompt's text span: the ids between
``<|sos|>`` (or ``<|endofprompt|>`` in instruct mode) and ``<|task_id|>``; when the request carries
``min_tokens`` (the gateway sends 2 per text token) the smaller of the span and ``min_tokens / 2``,
which leaves a zero-shot voice's transcript out. ``n == max_tokens`` ends with ``finish_reason:
"length"`` and no eos, as vLLM does.

A client that disconnects stops its stream at once (the running gauge drops). Dependencies: starlette,
uvicorn, numpy, and ``gateway.llm.vocab`` (pure Python) for the vocabulary layout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import subprocess
import sys
import time
import urllib.request
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.llm import vocab

log = logging.getLogger("replayer")


@dataclass(frozen=True)
class Timetable:
    """When token ``i`` of a stream is due, in seconds after the request arrived (``i == n``: the eos)."""

    prefill_s: float
    token_s: float

    def due(self, i: int) -> float:
        return self.prefill_s + i * self.token_s

    def count_due(self, elapsed_s: float, n: int) -> int:
        """How many of ``n`` tokens are due ``elapsed_s`` after the request arrived."""
        if elapsed_s < self.prefill_s:
            return 0
        if self.token_s <= 0:
            return n
        # a hair of tolerance so a token due exactly now is not left for the next wake-up
        return min(n, math.floor((elapsed_s - self.prefill_s) / self.token_s + 1e-9) + 1)


@dataclass
class ReplayerConfig:
    model: str = "cosyvoice2"
    prefill_ms: float = 20.0
    token_ms: float = 5.0
    tokens_per_text_token: float = 12.0
    tokens: int | None = None
    """Fixed speech-token count per request (instead of tokens_per_text_token x text tokens)."""
    seed: int = 0
    max_model_len: int = 2048
    """Context size: ``max_tokens`` defaults to what the prompt leaves of it."""

    @property
    def timetable(self) -> Timetable:
        return Timetable(self.prefill_ms / 1e3, self.token_ms / 1e3)


def text_token_count(prompt: list[int], min_tokens: int | None = None) -> int:
    """The prompt's input-text tokens (see the module doc)."""
    try:
        end = prompt.index(vocab.TASK_ID)
    except ValueError:
        end = len(prompt)
    start = -1
    for marker in (vocab.ENDOFPROMPT_ID, vocab.SOS_ID):  # instruct: text follows <|endofprompt|>
        if marker in prompt[:end]:
            start = end - 1 - prompt[:end][::-1].index(marker)
            break
    span = max(0, end - start - 1)
    if min_tokens and min_tokens > 0:
        span = min(span, math.ceil(min_tokens / 2))
    return span


def planned_tokens(config: ReplayerConfig, prompt: list[int], min_tokens: int | None, max_tokens: int) -> int:
    """How many speech tokens a request gets (before its eos)."""
    if config.tokens is not None:
        wanted = config.tokens
    else:
        wanted = round(config.tokens_per_text_token * text_token_count(prompt, min_tokens))
    return max(0, min(max(wanted, min_tokens or 0, 1), max_tokens))


def speech_tokens(seed: int, prompt: list[int], n: int) -> np.ndarray:
    """Vocabulary ids of ``n`` random speech tokens, the same for the same seed and prompt."""
    key = zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes())
    rng = np.random.default_rng([seed, key])
    return vocab.SPEECH_TOKEN_BASE_ID + rng.integers(0, vocab.SPEECH_TOKEN_COUNT, n)


class Stats:
    """What ``/metrics`` reports (names of vLLM's own metrics where one exists)."""

    def __init__(self) -> None:
        self.running = 0
        self.requests = 0
        self.aborted = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.lag_max = 0.0
        self.lag_sum = 0.0
        self.lag_count = 0

    def observe_lag(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.lag_max = max(self.lag_max, seconds)
        self.lag_sum += seconds
        self.lag_count += 1

    def prometheus(self, model: str) -> str:
        labels = f'{{engine="0",model_name="{model}"}}'
        rows = [
            ("vllm:num_requests_running", "gauge", "Requests being generated.", self.running),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting (never, here).", 0),
            ("vllm:prompt_tokens_total", "counter", "Prompt tokens received.", self.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Speech tokens sent.", self.generation_tokens),
            ("replayer_requests_total", "counter", "Completions started.", self.requests),
            ("replayer_aborted_total", "counter", "Streams the client left before their end.", self.aborted),
            ("replayer_lag_seconds_max", "gauge", "Latest a token event went out after its due time.", self.lag_max),
            ("replayer_lag_seconds_sum", "counter", "Sum of event lateness.", self.lag_sum),
            ("replayer_lag_seconds_count", "counter", "Token events sent.", self.lag_count),
        ]
        out = []
        for name, kind, help_text, value in rows:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value)}"]
        return "\n".join(out) + "\n"


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    # vLLM's error body
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None, "code": status},
                        status_code=status)


class _SSEStream:
    """An ASGI response that streams ``events`` and stops them as soon as the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], stats: Stats) -> None:
        self.events = events
        self.stats = stats

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.stats.running += 1
        completed = False
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache")]})

            async def pump() -> None:
                nonlocal completed
                async for chunk in self.events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                completed = True

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass

            tasks = [asyncio.ensure_future(pump()), asyncio.ensure_future(watch())]
            try:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                results = await asyncio.gather(*tasks, return_exceptions=True)
            error = results[0]
            if isinstance(error, Exception) and not isinstance(error, OSError):  # OSError: client gone
                log.error("stream failed: %r", error)
        finally:
            self.stats.running -= 1
            if not completed:
                self.stats.aborted += 1


def build_app(config: ReplayerConfig) -> Starlette:
    stats = Stats()
    timetable = config.timetable
    created = int(time.time())

    async def models(request: Request) -> Response:
        card = {"id": config.model, "object": "model", "created": created, "owned_by": "vllm",
                "root": config.model, "parent": None, "max_model_len": config.max_model_len, "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(stats.prometheus(config.model), media_type="text/plain; version=0.0.4")

    async def completions(request: Request) -> Response:
        arrived = asyncio.get_running_loop().time()
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if body.get("model") != config.model:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in prompt)):
            return _error(400, "the replayer takes the prompt as a non-empty list of token ids")
        room = config.max_model_len - len(prompt)
        max_tokens = body.get("max_tokens")
        max_tokens = room if max_tokens is None else int(max_tokens)
        if max_tokens < 1 or max_tokens > room:
            return _error(400, f"max_tokens {max_tokens} must be 1..{room} (context {config.max_model_len})")
        min_tokens = int(body.get("min_tokens") or 0)
        n = planned_tokens(config, prompt, min_tokens, max_tokens)
        ids = speech_tokens(config.seed, prompt, n)
        return_ids = bool(body.get("return_token_ids"))
        stats.requests += 1
        stats.prompt_tokens += len(prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))

        def choice(token_ids: list[int], finish: str | None, stop_reason: int | None, first: bool) -> dict:
            text = "".join(vocab.speech_token_text(t - vocab.SPEECH_TOKEN_BASE_ID) for t in token_ids
                           if t not in vocab.EOS_IDS)
            out: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                   "stop_reason": stop_reason}
            if return_ids:
                out["prompt_token_ids"] = prompt if first else None
                out["token_ids"] = token_ids
            return out

        def event(token_ids: list[int], finish: str | None = None, stop_reason: int | None = None,
                  first: bool = False) -> bytes:
            payload = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                       "model": config.model, "choices": [choice(token_ids, finish, stop_reason, first)]}
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        ends_with_eos = n < max_tokens

        async def events() -> AsyncIterator[bytes]:
            loop = asyncio.get_running_loop()
            sent = 0
            while sent < n:
                delay = arrived + timetable.due(sent) - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                now = loop.time()
                stats.observe_lag(now - arrived - timetable.due(sent))
                upto = max(sent + 1, timetable.count_due(now - arrived, n))
                batch = [int(t) for t in ids[sent:upto]]
                first = sent == 0
                sent = upto
                stats.generation_tokens += len(batch)
                last = sent == n and not ends_with_eos
                yield event(batch, "length" if last else None, first=first)
            if ends_with_eos:
                delay = arrived + timetable.due(n) - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                yield event([vocab.EOS1_ID], "stop", vocab.EOS1_ID, first=n == 0)
            yield b"data: [DONE]\n\n"

        if stream:
            return _SSEStream(events(), stats)  # type: ignore[return-value]
        # non-streaming: wait for the whole timetable, answer once
        stats.running += 1
        try:
            await asyncio.sleep(max(0.0, arrived + timetable.due(n) - asyncio.get_running_loop().time()))
        finally:
            stats.running -= 1
        stats.generation_tokens += n
        token_ids = [int(t) for t in ids] + ([vocab.EOS1_ID] if ends_with_eos else [])
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": int(time.time()), "model": config.model,
            "choices": [{**choice(token_ids, "stop" if ends_with_eos else "length",
                                  vocab.EOS1_ID if ends_with_eos else None, True)}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(token_ids),
                      "total_tokens": len(prompt) + len(token_ids)},
        })

    app = Starlette(routes=[
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]),
    ])
    app.state.stats = stats
    app.state.config = config
    return app


@contextlib.contextmanager
def replayer_process(port: int, *args: str, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Run ``python -m backends.llm.replayer --port PORT ARGS...`` in a subprocess (benchmark scripts
    start it beside the servers under test); yields its base URL (``.../v1``) once /health answers,
    terminates it on exit."""
    process = subprocess.Popen([sys.executable, "-m", "backends.llm.replayer", "--host", "127.0.0.1",
                                "--port", str(port), *args])
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the replayer exited with code {process.returncode}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{root}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replayer did not answer {root}/health within {startup_timeout_s:.0f} s")
            time.sleep(0.2)
        yield f"{root}/v1"
    finally:
        process.terminate()
        process.wait(10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m backends.llm.replayer", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="cosyvoice2", help="served model name (requests must use it)")
    parser.add_argument("--prefill-ms", type=float, default=20.0, help="request arrival to first token")
    parser.add_argument("--token-ms", type=float, default=5.0, help="between tokens, per stream")
    parser.add_argument("--tokens-per-text-token", type=float, default=12.0)
    parser.add_argument("--tokens", type=int, default=None, help="fixed speech tokens per request instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    config = ReplayerConfig(model=args.model, prefill_ms=args.prefill_ms, token_ms=args.token_ms,
                            tokens_per_text_token=args.tokens_per_text_token, tokens=args.tokens, seed=args.seed,
                            max_model_len=args.max_model_len)
    import uvicorn

    print(f"replayer: {config.model} at http://{args.host}:{args.port}/v1 (prefill {config.prefill_ms} ms, "
          f"{config.token_ms} ms/token)", flush=True)
    uvicorn.run(build_app(config), host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
