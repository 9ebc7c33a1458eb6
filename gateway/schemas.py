"""Request/response bodies of the OpenAI audio API, validated exactly as the contract says.

Validation errors carry OpenAI-style codes (``missing_required_parameter``, ``invalid_type``,
``invalid_value``, ``string_above_max_length`` ...) as their pydantic error type, so
``gateway.errors.validation_error_to_api_error`` can turn the first one into a 400 whose ``param``
names the offending field. Unknown fields are ignored, as the real API does.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gateway.audio import FORMATS
from gateway.errors import json_type_name, validation_error_to_api_error
from gateway.voices import BUILTIN_VOICES

MAX_INPUT_CHARS = 4096
MAX_INSTRUCTIONS_CHARS = 4096
MIN_SPEED = 0.25
MAX_SPEED = 4.0
STREAM_FORMATS = ("audio", "sse")

ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
StreamFormat = Literal["audio", "sse"]
assert set(FORMATS) == set(ResponseFormat.__args__)  # type: ignore[attr-defined]


def _shown(value: Any) -> str:
    """A client value quoted in an error message, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _invalid_type(field: str, expected: str, value: Any) -> PydanticCustomError:
    return PydanticCustomError(
        "invalid_type",
        "Invalid type for '{field}': expected {expected}, but got {got} instead.",
        {"field": field, "expected": expected, "got": json_type_name(value)},
    )


def _require_string(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _invalid_type(field, "a string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape such as "\\ud800" in the JSON
        raise PydanticCustomError(
            "invalid_value", "'{field}' contains invalid Unicode (an unpaired surrogate).", {"field": field}
        ) from None
    return value


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> str:
    value = _require_string(field, value)
    if value not in choices:
        raise PydanticCustomError(
            "invalid_value",
            "Invalid value for '{field}': {value}. Supported values are: {choices}.",
            {"field": field, "value": _shown(value), "choices": ", ".join(repr(c) for c in choices)},
        )
    return value


class VoiceRef(BaseModel):
    """A custom voice: ``{"id": "voice_..."}``."""

    model_config = ConfigDict(extra="ignore")
    id: str


class SpeechRequest(BaseModel):
    """``POST /v1/audio/speech`` body."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str = Field(description=f"Text to speak: non-empty, at most {MAX_INPUT_CHARS} characters (code points).")
    voice: str | VoiceRef = Field(description="A built-in voice name or {\"id\": \"voice_...\"}.")
    instructions: str | None = Field(default=None, description=f"At most {MAX_INSTRUCTIONS_CHARS} characters.")
    response_format: ResponseFormat = "mp3"
    speed: float = Field(default=1.0, description=f"{MIN_SPEED} to {MAX_SPEED}, inclusive.")
    stream_format: StreamFormat = "audio"
    normalize: bool | None = Field(
        default=None,
        description="Extension: read numbers, dates, units and symbols as words; false sends the text "
        "as written. Omitted or null: the server's default (TTS_TEXT_NORMALIZATION, on).",
    )

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_default(cls, data: Any) -> Any:
        """An explicit ``null`` for an optional field means "use the default" (as if omitted)."""
        if isinstance(data, dict):
            optional = ("instructions", "response_format", "speed", "stream_format", "normalize")
            data = {k: v for k, v in data.items() if not (k in optional and v is None)}
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _check_model(cls, value: Any) -> str:
        return _require_string("model", value)

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> str:
        value = _require_string("input", value)
        if not value.strip():
            raise PydanticCustomError("empty_string", "'input' must be a non-empty string.")
        if len(value) > MAX_INPUT_CHARS:
            raise PydanticCustomError(
                "string_above_max_length",
                "'input' is too long: {length} characters, the maximum is {limit}.",
                {"length": len(value), "limit": MAX_INPUT_CHARS},
            )
        return value

    @field_validator("voice", mode="before")
    @classmethod
    def _check_voice(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _check_choice("voice", value, BUILTIN_VOICES)
        if isinstance(value, dict):
            voice_id = value.get("id")
            if not isinstance(voice_id, str) or not voice_id:
                raise PydanticCustomError(
                    "invalid_value", "'voice' must be a built-in voice name or an object {\"id\": \"voice_...\"}."
                )
            return value
        raise _invalid_type("voice", "a string or an object", value)

    @field_validator("instructions", mode="before")
    @classmethod
    def _check_instructions(cls, value: Any) -> str:
        value = _require_string("instructions", value)
        if len(value) > MAX_INSTRUCTIONS_CHARS:
            raise PydanticCustomError(
                "string_above_max_length",
                "'instructions' is too long: {length} characters, the maximum is {limit}.",
                {"length": len(value), "limit": MAX_INSTRUCTIONS_CHARS},
            )
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _check_response_format(cls, value: Any) -> str:
        return _check_choice("response_format", value, FORMATS)

    @field_validator("stream_format", mode="before")
    @classmethod
    def _check_stream_format(cls, value: Any) -> str:
        return _check_choice("stream_format", value, STREAM_FORMATS)

    @field_validator("normalize", mode="before")
    @classmethod
    def _check_normalize(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise _invalid_type("normalize", "a boolean", value)
        return value

    @field_validator("speed", mode="before")
    @classmethod
    def _check_speed(cls, value: Any) -> float:
        # JSON ints are fine; booleans (a Python int subclass) and strings are not.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _invalid_type("speed", "a number", value)
        try:
            speed = float(value)
        except OverflowError:
            speed = math.inf
        if math.isnan(speed) or speed < MIN_SPEED:
            raise PydanticCustomError(
                "decimal_below_min_value",
                "Invalid 'speed': {value}. Expected a value between {low} and {high}.",
                {"value": _shown(value), "low": MIN_SPEED, "high": MAX_SPEED},
            )
        if speed > MAX_SPEED:
            raise PydanticCustomError(
                "decimal_above_max_value",
                "Invalid 'speed': {value}. Expected a value between {low} and {high}.",
                {"value": _shown(value), "low": MIN_SPEED, "high": MAX_SPEED},
            )
        return speed

    def voice_for_job(self) -> str | dict:
        """What ``SpeechJob.voice`` carries: the built-in name, or ``{"id": ...}``."""
        return self.voice if isinstance(self.voice, str) else {"id": self.voice.id}


def parse_speech_request(body: Any) -> SpeechRequest:
    """Validate a decoded JSON body; raises a 400 ``APIError`` naming the first bad field."""
    try:
        return SpeechRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc.errors()) from None


# --- models ----------------------------------------------------------------------------------------


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


__all__ = [
    "MAX_INPUT_CHARS",
    "MAX_INSTRUCTIONS_CHARS",
    "MAX_SPEED",
    "MIN_SPEED",
    "ModelList",
    "ModelObject",
    "SpeechRequest",
    "VoiceRef",
    "parse_speech_request",
]
