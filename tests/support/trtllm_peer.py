"""A STAND-IN for trtllm-serve's /v1/completions protocol, for tests (trtllm-serve itself needs a GPU build).

It is not a model: it plays back pseudo-random speech tokens. What it reproduces is the protocol
behaviour the client depends on (ARCHITECTURE.md, "The servers"):
- the request schema forbids unknown fields: any key outside trtllm-serve's CompletionRequest -> 400
  with an OpenAI-style error body (as trtllm-serve's pydantic ``extra="forbid"`` models do);
- ``detokenize: false`` -> each SSE chunk carries ``token_ids`` and empty text; otherwise text only;
- ``stop_token_ids`` end generation (the stop id is the last token_ids entry, finish_reason "stop");
- ``/v1/models`` names ``owned_by: "tensorrt_llm"``; ``/health``; ``/metrics`` is JSON, not Prometheus;
- a client that disconnects mid-stream aborts its request (counted in ``aborted``).

Knobs for failure tests: ``fail_status`` (answer every completion with that status), ``error_after``
(send an error event after N tokens), ``token_delay_s`` (pace of generation), ``eos_after`` (when the
"model" emits eos1), ``honour_min_tokens`` (False behaves like an older 1.x that ignores min_tokens).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from gateway.llm import vocab


class PeerCompletionRequest(BaseModel):
    """The subset of trtllm-serve's CompletionRequest fields the peer accepts; everything else is 400."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: list[int] | str
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0
    stream: bool | None = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None


@dataclass
class PeerState:
    token_delay_s: float = 0.002
    eos_after: int = 30
    honour_min_tokens: bool = True
    fail_status: int | None = None
    error_after: int | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    running: int = 0
    completed: int = 0
    aborted: int = 0


def _error(status: int, message: str) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse({"object": "error", "message": message, "type": kind, "code": status}, status_code=status)


def build_app(state: PeerState) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def reject(request: Request, exc: RequestValidationError) -> JSONResponse:
        state.rejected.append({"errors": str(exc.errors())[:500]})
        return _error(400, str(exc.errors()))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": "cosyvoice2", "object": "model", "created": int(time.time()), "owned_by": "tensorrt_llm"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> list[dict[str, Any]]:
        return [{"numActiveRequests": state.running, "numCompletedRequests": state.completed}]

    @app.post("/v1/completions")
    async def completions(body: PeerCompletionRequest) -> Any:
        state.requests.append(body.model_dump(exclude_unset=True))
        if state.fail_status is not None:
            return _error(state.fail_status, "injected failure")
        if not body.stream:
            return _error(400, "the peer only streams")
        return StreamingResponse(_generate(state, body), media_type="text/event-stream")

    return app


async def _generate(state: PeerState, body: PeerCompletionRequest):
    rng = random.Random(json.dumps(body.prompt))
    stop_ids = set(body.stop_token_ids or [])
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    eos_at = max(state.eos_after, body.min_tokens) if state.honour_min_tokens else state.eos_after
    state.running += 1
    finished = False
    try:
        for step in range(max_tokens):
            await asyncio.sleep(state.token_delay_s)
            if state.error_after is not None and step >= state.error_after:
                yield f"data: {json.dumps({'error': {'message': 'engine failure', 'code': 500}})}\n\n"
                finished = True
                return
            if step >= eos_at and not body.ignore_eos:
                token = vocab.EOS1_ID
            else:
                token = vocab.SPEECH_TOKEN_BASE_ID + rng.randrange(vocab.SPEECH_TOKEN_COUNT)
            stop = token in stop_ids
            last = stop or step == max_tokens - 1
            yield _chunk(body, token, ("stop" if stop else "length") if last else None)
            if stop:
                break
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        state.running -= 1
        if finished:
            state.completed += 1
        else:
            state.aborted += 1


def _chunk(body: PeerCompletionRequest, token: int, finish_reason: str | None) -> str:
    if body.detokenize:
        s = token - vocab.SPEECH_TOKEN_BASE_ID
        text = f"<|s_{s}|>" if 0 <= s < vocab.SPEECH_TOKEN_COUNT else ""
        choice = {"index": 0, "text": text, "token_ids": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": "", "token_ids": [token], "finish_reason": finish_reason}
    event = {"id": "cmpl-peer", "object": "text_completion", "created": 0, "model": body.model, "choices": [choice]}
    return f"data: {json.dumps(event)}\n\n"


class TrtllmPeer:
    """Runs the peer with uvicorn in a background thread on an ephemeral port."""

    def __init__(self, *, log_level: str = "warning", **knobs: Any) -> None:
        self.state = PeerState(**knobs)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(build_app(self.state), log_level=log_level, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> TrtllmPeer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("trtllm peer did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
