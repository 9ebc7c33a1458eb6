"""Custom voices and voice consents: ``/v1/audio/voices`` and ``/v1/audio/voice_consents``.

``install_voice_routes(app, settings, synthesizer)`` builds the voice store from the settings,
hands it to the synthesizer's ``VoiceRegistry`` (so ``voice={"id": ...}`` resolves) and mounts the
router. Bodies are parsed by hand (like ``/v1/audio/speech``) so every failure is the OpenAI
envelope with the right ``param``.

Extensions beyond the OpenAI API (documented in the README): ``transcript`` on voice creation
(the sample's words; without it the voice is used cross-lingually) and ``GET /v1/audio/voices``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.datastructures import FormData, UploadFile

from gateway.audio_decode import DecodedAudio, decode_upload
from gateway.errors import APIError, InvalidRequestError, NotFoundError, ServiceUnavailableError
from gateway.settings import Settings
from gateway.voice_store import (
    Consent,
    VoiceStore,
    is_consent_id,
    is_voice_id,
    new_consent_id,
    new_voice_id,
    now_ns,
    store_from_settings,
)
from gateway.voices import Voice, VoiceRegistry

log = logging.getLogger("gateway.voices")

MAX_SAMPLE_BYTES = 10 * 1024 * 1024
MAX_NAME_CHARS = 256
MAX_TRANSCRIPT_CHARS = 2000
#: BCP-47 shape (language, then subtags); not a registry lookup.
BCP47_RE = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8})*$")


class VoiceService:
    """The store plus the lazily loaded encoder (loading the tokenizer takes a while; only uploads need it)."""

    def __init__(self, settings: Settings, store: VoiceStore) -> None:
        self.settings = settings
        self.store = store
        self._encoder: Any = None
        self._encoder_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(max(1, settings.voice_encoder_threads))

    async def encoder(self) -> Any:
        if not self.settings.voice_encoder_dir:
            raise ServiceUnavailableError(
                "Voice creation is not configured on this server (TTS_VOICE_ENCODER_DIR is empty).",
                code="voice_encoder_unavailable",
            )
        async with self._encoder_lock:
            if self._encoder is None:
                from backends.voices.encoder import VoiceEncoder  # numpy + onnxruntime only

                try:
                    self._encoder = await asyncio.to_thread(VoiceEncoder, self.settings.voice_encoder_dir)
                except FileNotFoundError as exc:
                    log.error("voice encoder unavailable: %s", exc)
                    raise ServiceUnavailableError(
                        "The voice encoder models are missing on this server.", code="voice_encoder_unavailable"
                    ) from None
            return self._encoder

    async def make_voice(self, voice_id: str, name: str, transcript: str, consent_id: str, audio: DecodedAudio) -> Voice:
        encoder = await self.encoder()
        async with self._slots:
            try:
                prompt = await asyncio.to_thread(encoder.encode, audio.pcm_16k, audio.pcm_24k)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="audio_sample") from None
        created_ns = now_ns()
        return Voice(
            id=voice_id,
            name=name,
            prompt_text=transcript,
            prompt_tokens=prompt.prompt_tokens,
            prompt_mel=prompt.prompt_mel,
            speaker_embedding=prompt.speaker_embedding,
            lookahead_pad="silence",
            model_hash=prompt.model_hash,
            created_at=created_ns // 1_000_000_000,
            extra={"consent": consent_id, "created_ns": created_ns, "type": "audio_sample"},
        )


def voice_object(voice: Voice) -> dict[str, Any]:
    return {"object": "audio.voice", "id": voice.id, "name": voice.name, "created_at": voice.created_at, "type": "audio_sample"}


def consent_object(consent: Consent) -> dict[str, Any]:
    return {
        "object": "audio.voice_consent",
        "id": consent.id,
        "name": consent.name,
        "language": consent.language,
        "created_at": consent.created_at,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


async def read_form(request: Request) -> FormData:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        raise InvalidRequestError(
            f"Invalid Content-Type {media_type!r}: send multipart/form-data.", code="invalid_content_type"
        )
    try:
        return await request.form()
    except Exception as exc:  # starlette raises several types for malformed multipart bodies
        if isinstance(exc, APIError):
            raise
        raise InvalidRequestError(f"The multipart body could not be parsed: {exc}", code="invalid_multipart") from None


def text_field(form: FormData, name: str, *, required: bool, max_chars: int) -> str:
    value = form.get(name)
    if value is None:
        if required:
            raise InvalidRequestError(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{name}' must be a text field, not a file.", param=name)
    value = value.strip()
    if required and not value:
        raise InvalidRequestError(f"'{name}' must not be empty.", param=name)
    if len(value) > max_chars:
        raise InvalidRequestError(f"'{name}' is longer than {max_chars} characters.", param=name)
    return value


async def file_field(form: FormData, name: str) -> bytes:
    value = form.get(name)
    if value is None:
        raise InvalidRequestError(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    if not isinstance(value, UploadFile):
        raise InvalidRequestError(f"'{name}' must be a file part.", param=name)
    data = await value.read(MAX_SAMPLE_BYTES + 1)
    if len(data) > MAX_SAMPLE_BYTES:
        raise APIError(413, f"'{name}' is larger than {MAX_SAMPLE_BYTES} bytes.", param=name, code="file_too_large")
    return data


async def decode_audio(data: bytes, param: str) -> DecodedAudio:
    try:
        return await asyncio.to_thread(decode_upload, data)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param=param, code="invalid_audio") from None


def paging(request: Request, id_check: Any) -> tuple[str | None, int]:
    query = request.query_params
    raw_limit = query.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise InvalidRequestError("'limit' must be an integer from 1 to 100.", param="limit")
    after = query.get("after") or None
    if after is not None and not id_check(after):
        raise InvalidRequestError("'after' is not a valid id.", param="after")
    return after, limit


def multipart_body(fields: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    """``openapi_extra`` for a route that parses its multipart body itself (so /docs shows the form)."""
    schema = {"type": "object", "properties": fields, "required": required}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


BINARY = {"type": "string", "format": "binary"}
VOICE_FORM = multipart_body(
    {
        "name": {"type": "string"},
        "audio_sample": {**BINARY, "description": "1-30 s, <= 10 MiB; mpeg wav ogg aac flac webm mp4"},
        "consent": {"type": "string", "description": "a consent id, cons_..."},
        "type": {"type": "string", "enum": ["audio_sample"]},
        "transcript": {"type": "string", "description": "extension: the words spoken in audio_sample"},
    },
    ["name", "audio_sample", "consent"],
)
CONSENT_FORM = multipart_body(
    {"name": {"type": "string"}, "language": {"type": "string", "description": "BCP 47"}, "recording": BINARY},
    ["name", "language", "recording"],
)


def build_router(service: VoiceService) -> APIRouter:
    router = APIRouter()
    store = service.store

    @router.post("/v1/audio/voices", openapi_extra=VOICE_FORM)
    async def create_voice(request: Request) -> dict[str, Any]:
        form = await read_form(request)
        kind = text_field(form, "type", required=False, max_chars=32) or "audio_sample"
        if kind != "audio_sample":
            raise InvalidRequestError(f"Unsupported voice type {kind!r}: only 'audio_sample' is supported.", param="type")
        name = text_field(form, "name", required=True, max_chars=MAX_NAME_CHARS)
        consent_id = text_field(form, "consent", required=True, max_chars=64)
        transcript = text_field(form, "transcript", required=False, max_chars=MAX_TRANSCRIPT_CHARS)
        if not is_consent_id(consent_id) or await store.get_consent(consent_id) is None:
            raise InvalidRequestError(f"Consent {consent_id!r} not found.", param="consent", code="consent_not_found")
        audio = await decode_audio(await file_field(form, "audio_sample"), "audio_sample")
        voice = await service.make_voice(new_voice_id(), name, transcript, consent_id, audio)
        await store.put_voice(voice)
        log.info("created voice %s (%.1f s %s, %d tokens)", voice.id, audio.duration_s, audio.format, voice.prompt_tokens.size)
        return voice_object(voice)

    @router.get("/v1/audio/voices")
    async def list_voices(request: Request) -> dict[str, Any]:
        after, limit = paging(request, is_voice_id)
        page = await store.list_voices(after, limit)
        return list_object([voice_object(v) for v in page.items], page.has_more)

    @router.delete("/v1/audio/voices/{voice_id}")
    async def delete_voice(voice_id: str) -> dict[str, Any]:
        if not is_voice_id(voice_id) or not await store.delete_voice(voice_id):
            raise NotFoundError(f"Voice {voice_id!r} not found.", param="voice_id", code="voice_not_found")
        return {"id": voice_id, "object": "audio.voice.deleted", "deleted": True}

    @router.post("/v1/audio/voice_consents", openapi_extra=CONSENT_FORM)
    async def create_consent(request: Request) -> dict[str, Any]:
        form = await read_form(request)
        name = text_field(form, "name", required=True, max_chars=MAX_NAME_CHARS)
        language = text_field(form, "language", required=True, max_chars=35)
        if not BCP47_RE.fullmatch(language):
            raise InvalidRequestError(f"'language' must be a BCP 47 tag such as 'en-US', got {language!r}.", param="language")
        recording = await file_field(form, "recording")
        await decode_audio(recording, "recording")
        created_ns = now_ns()
        consent = Consent(new_consent_id(), name, language, created_ns // 1_000_000_000, created_ns)
        await store.put_consent(consent, recording)
        return consent_object(consent)

    @router.get("/v1/audio/voice_consents")
    async def list_consents(request: Request) -> dict[str, Any]:
        after, limit = paging(request, is_consent_id)
        page = await store.list_consents(after, limit)
        return list_object([consent_object(c) for c in page.items], page.has_more)

    async def existing_consent(consent_id: str) -> Consent:
        consent = await store.get_consent(consent_id) if is_consent_id(consent_id) else None
        if consent is None:
            raise NotFoundError(f"Consent {consent_id!r} not found.", param="consent_id", code="consent_not_found")
        return consent

    @router.get("/v1/audio/voice_consents/{consent_id}")
    async def retrieve_consent(consent_id: str) -> dict[str, Any]:
        return consent_object(await existing_consent(consent_id))

    @router.post("/v1/audio/voice_consents/{consent_id}")
    async def update_consent(consent_id: str, request: Request) -> dict[str, Any]:
        consent = await existing_consent(consent_id)
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type == "application/json":
            try:
                body = json.loads(await request.body())
            except ValueError:
                raise InvalidRequestError("The body must be a JSON object.", code="invalid_json") from None
            if not isinstance(body, dict):
                raise InvalidRequestError("The body must be a JSON object.", code="invalid_json")
            name = body.get("name")
            if not isinstance(name, str) or not name.strip() or len(name.strip()) > MAX_NAME_CHARS:
                raise InvalidRequestError("'name' must be a non-empty string.", param="name")
            name = name.strip()
        else:
            name = text_field(await read_form(request), "name", required=True, max_chars=MAX_NAME_CHARS)
        updated = Consent(consent.id, name, consent.language, consent.created_at, consent.created_ns)
        await store.put_consent(updated, None)
        return consent_object(updated)

    @router.delete("/v1/audio/voice_consents/{consent_id}")
    async def delete_consent(consent_id: str) -> dict[str, Any]:
        if not is_consent_id(consent_id) or not await store.delete_consent(consent_id):
            raise NotFoundError(f"Consent {consent_id!r} not found.", param="consent_id", code="consent_not_found")
        return {"id": consent_id, "object": "audio.voice_consent", "deleted": True}

    return router


def install_voice_routes(app: FastAPI, settings: Settings, synthesizer: object) -> VoiceService:
    """Mount the routes and give the synthesizer's voice registry (if it has one) the same store."""
    service = VoiceService(settings, store_from_settings(settings))
    registry = getattr(synthesizer, "voices", None)
    if isinstance(registry, VoiceRegistry):
        registry.store = service.store
    app.state.voice_service = service
    app.include_router(build_router(service))
    app_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan_closing_the_store(a: FastAPI) -> AsyncIterator[Any]:
        """The app's own lifespan, then the store's connections closed (Redis) at shutdown."""
        async with app_lifespan(a) as state:
            try:
                yield state
            finally:
                await service.store.aclose()

    app.router.lifespan_context = lifespan_closing_the_store
    return service


__all__ = ["VoiceService", "install_voice_routes", "build_router", "voice_object", "consent_object"]
