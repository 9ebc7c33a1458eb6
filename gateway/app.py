"""The OpenAI-compatible HTTP API.

``create_app(settings, synthesizer)`` builds the FastAPI app around any ``Synthesizer`` (tests pass
doubles); ``gateway.app:app`` is the production app for uvicorn, built on first access from
``get_settings()`` with the real synthesizer (see ``build_synthesizer``); building it also sets up
the process's logging (``gateway.logs``: JSON lines carrying the request id by default).

``POST /v1/audio/speech`` reads and checks the body itself (Content-Type, JSON, object, schema,
model) instead of letting FastAPI parse it, so every failure is the OpenAI envelope with the right
``param``, and everything is validated before the 200 is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway import sse
from gateway.admission import AdmissionController, ClientClosedRequest, GuardedSpeech, Permit, RequestTimeoutError
from gateway.audio import CONTENT_TYPES, make_encoder
from gateway.auth import APIKeyMiddleware, load_api_keys
from gateway.errors import InvalidRequestError, ModelNotFoundError, install_error_handlers, request_id_of
from gateway.logs import configure_logging
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestContextMiddleware, new_request_id
from gateway.routes_voices import install_voice_routes
from gateway.schemas import ModelList, ModelObject, SpeechRequest, parse_speech_request
from gateway.settings import Settings, get_settings
from gateway.streaming import SpeechStreamResponse
from gateway.synth import SAMPLE_RATE, SpeechJob, Synthesizer

log = logging.getLogger("gateway.app")

#: ``created`` of every model object (a fixed date: the ids are aliases, not trained artifacts).
MODELS_CREATED = 1_735_689_600
MODELS_OWNED_BY = "system"
#: Paths whose bodies are file uploads and get ``settings.max_upload_bytes`` instead of ``max_body_bytes``.
UPLOAD_PATH_PREFIXES = ("/v1/audio/voices", "/v1/audio/voice_consents")


def create_app(settings: Settings, synthesizer: Synthesizer) -> FastAPI:
    """The API over ``synthesizer``.

    If the synthesizer has ``async start()`` / ``async aclose()`` they run at app startup/shutdown;
    ``async ready() -> dict[str, bool]`` feeds /ready; ``attach_metrics(metrics)`` gets the backend
    latency histograms. On shutdown in-flight streams drain (``settings.shutdown_drain_s``) before
    the backends close.
    """
    metrics = GatewayMetrics()
    admission = AdmissionController(
        max_total=settings.max_concurrent_streams,
        max_per_key=settings.max_streams_per_key,
        retry_after_s=settings.admission_retry_after_s,
        metrics=metrics,
    )
    attach_metrics = getattr(synthesizer, "attach_metrics", None)
    if attach_metrics is not None:
        attach_metrics(metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        admission.reopen()
        start = getattr(synthesizer, "start", None)
        if start is not None:
            await start()
        try:
            yield
        finally:
            await admission.drain(settings.shutdown_drain_s)
            aclose = getattr(synthesizer, "aclose", None)
            if aclose is not None:
                await aclose()

    app = FastAPI(title="OpenAI-compatible speech API", version="0.1.0", lifespan=lifespan, redoc_url=None)
    app.state.settings = settings
    app.state.synthesizer = synthesizer
    app.state.metrics = metrics
    app.state.admission = admission
    install_error_handlers(app)

    def body_limit(path: str) -> int:
        return settings.max_upload_bytes if path.startswith(UPLOAD_PATH_PREFIXES) else settings.max_body_bytes

    # Added first, so it runs inside RequestContextMiddleware and its 401 carries the request id.
    app.add_middleware(
        APIKeyMiddleware, keys=load_api_keys(settings), protect_metrics=settings.metrics_require_auth, metrics=metrics
    )
    app.add_middleware(RequestContextMiddleware, body_limit=body_limit)

    model_ids = [settings.served_model, *(a for a in settings.model_aliases if a != settings.served_model)]

    def model_object(model_id: str) -> ModelObject:
        return ModelObject(id=model_id, created=MODELS_CREATED, owned_by=MODELS_OWNED_BY)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", response_model=None)
    async def ready() -> dict[str, Any] | JSONResponse:
        """Both backends reachable (per backend), 503 naming the ones that are not."""
        probe = getattr(synthesizer, "ready", None)
        backends: dict[str, bool] = dict(await probe()) if probe is not None else {}
        down = sorted(name for name, ok in backends.items() if not ok)
        if admission.draining:
            down.append("gateway (shutting down)")
        if down:
            message = f"Not ready: {', '.join(down)} unavailable."
            return JSONResponse(
                {"status": "unavailable", "backends": backends, "error": message},
                status_code=503,
                headers={"retry-after": str(max(1, round(settings.admission_retry_after_s)))},
            )
        return {"status": "ok", "backends": backends}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_object(model_id) for model_id in model_ids])

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelObject:
        if model_id not in model_ids:
            raise ModelNotFoundError(model_id)
        return model_object(model_id)

    @app.post("/v1/audio/speech", response_model=None, openapi_extra=speech_openapi())
    async def create_speech(request: Request) -> SpeechStreamResponse | JSONResponse:
        body = await read_json_object(request)
        speech = parse_speech_request(body)
        if speech.model not in model_ids:
            raise ModelNotFoundError(speech.model)
        request_id = request_id_of(request) or new_request_id()
        arrived = time.monotonic()
        job = SpeechJob(
            request_id=request_id,
            model=speech.model,
            input=speech.input,
            voice=speech.voice_for_job(),
            instructions=speech.instructions,
            speed=speech.speed,
            response_format=speech.response_format,
            stream_format=speech.stream_format,
            normalize=speech.normalize,
        )
        permit = admission.acquire(request.scope.get("state", {}).get("api_key_id"))
        try:
            prepared = await prepare_unless_gone(request, job)
            encoder = make_encoder(speech.response_format, sample_rate=SAMPLE_RATE)
        except BaseException as exc:
            permit.release()
            if isinstance(exc, Exception):
                metrics.error(getattr(exc, "code", None) or "internal_error")
            raise
        guarded = GuardedSpeech(
            prepared,
            permit,
            request_id=request_id,
            arrived=arrived,
            request_timeout_s=settings.request_timeout_s,
            idle_timeout_s=settings.stream_idle_timeout_s,
            metrics=metrics,
        )
        return AdmittedSpeechResponse(
            guarded, encoder, sse=speech.stream_format == "sse", request_id=request_id, permit=permit
        )

    async def prepare_unless_gone(request: Request, job: SpeechJob) -> Any:
        """``prepare_in_time``, cancelled as soon as the client disconnects (the body was read, so
        the next ASGI message is the disconnect): a client that leaves while the LLM has not yet
        produced its first token does not keep the generation running until it does."""
        preparing = asyncio.ensure_future(prepare_in_time(job))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({preparing, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not preparing.done():
                preparing.cancel()
        if preparing.done() and not preparing.cancelled():
            return preparing.result()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await preparing
        log.info("request %s: client disconnected before the first audio", job.request_id)
        raise ClientClosedRequest()

    async def prepare_in_time(job: SpeechJob) -> Any:
        """``synthesizer.prepare`` bounded by the idle timeout (it waits for the LLM's first token)."""
        limits = [t for t in (settings.stream_idle_timeout_s, settings.request_timeout_s) if t > 0]
        try:
            return await asyncio.wait_for(synthesizer.prepare(job), min(limits) if limits else None)
        except asyncio.TimeoutError:
            raise RequestTimeoutError("The speech backends did not start producing in time.") from None

    install_voice_routes(app, settings, synthesizer)  # /v1/audio/voices, /v1/audio/voice_consents (issue 5)
    return app


class AdmittedSpeechResponse(SpeechStreamResponse):
    """Releases the admission permit when the response is done, even if the PCM iterator never ran."""

    def __init__(self, *args: Any, permit: Permit, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.permit = permit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.permit.release()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def speech_openapi() -> dict[str, Any]:
    """The speech body and responses for /docs (the endpoint parses its body itself, so FastAPI can't infer them)."""
    schema = SpeechRequest.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(definitions[ref.rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    audio = {content_type: {"schema": {"type": "string", "format": "binary"}} for content_type in CONTENT_TYPES.values()}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}},
        "responses": {"200": {"description": "Chunked audio, or SSE events", "content": {**audio, sse.CONTENT_TYPE: {}}}},
    }


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying exactly what is wrong with it."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise InvalidRequestError(
            f"Invalid Content-Type {content_type!r}: the body must be JSON sent as 'application/json'.",
            code="invalid_content_type",
        )
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, absurd numbers or nesting
        raise InvalidRequestError(
            "We could not parse the JSON body of your request. The API expects a JSON object.",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object.", code="invalid_json")
    return body


def build_synthesizer(settings: Settings) -> Synthesizer:
    """The production synthesizer: the LLM → token2wav pipeline (imported here so tests of the HTTP
    layer need neither backend client)."""
    from gateway.pipeline import SpeechPipeline

    return SpeechPipeline.from_settings(settings)


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    """``gateway.app:app`` for uvicorn, built lazily so importing this module needs no backends."""
    global _app
    if name == "app":
        if _app is None:
            settings = get_settings()
            configure_logging(settings.log_format, settings.log_level)  # after uvicorn's own set-up
            _app = create_app(settings, build_synthesizer(settings))
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
