"""Persisted custom voices and voice consents, shared by every gateway replica that points at one store.

Two backends behind one async interface (``VoiceStore``):

* ``LocalVoiceStore`` -- a directory (default ``<voices_dir>/custom``): ``voices/voice_<hex>.npz``
  written with ``gateway.voices.save_voice`` (no pickle), ``consents/cons_<hex>.json`` plus the raw
  consent recording beside it. Survives restarts; shared only by processes on one filesystem.
* ``RedisVoiceStore`` -- Redis (``redis.asyncio``): the same ``.npz`` bytes and JSON under prefixed
  keys, with one sorted set per kind for ordered, cursor-paged listing. Several gateways share it.

``CachedVoiceStore`` wraps either with a bounded LRU of decoded voices. A cached voice is only
returned after the backend confirms it still exists (a cheap EXISTS / stat), because another
replica may have deleted it: voices are immutable, so the cache saves the transfer and decode,
never the existence check.

Ids are ``voice_`` / ``cons_`` + 32 random hex digits; every id is checked against ``VOICE_ID_RE`` /
``CONSENT_ID_RE`` before it becomes part of a path or key, and an id that does not match is simply
"not found".
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gateway.voices import Voice, load_voice, save_voice

if TYPE_CHECKING:
    from gateway.settings import Settings

VOICE_ID_RE = re.compile(r"^voice_[0-9a-f]{32}$")
CONSENT_ID_RE = re.compile(r"^cons_[0-9a-f]{32}$")


def new_voice_id() -> str:
    return "voice_" + secrets.token_hex(16)


def new_consent_id() -> str:
    return "cons_" + secrets.token_hex(16)


def is_voice_id(value: object) -> bool:
    return isinstance(value, str) and VOICE_ID_RE.fullmatch(value) is not None


def is_consent_id(value: object) -> bool:
    return isinstance(value, str) and CONSENT_ID_RE.fullmatch(value) is not None


@dataclass(frozen=True)
class Consent:
    id: str
    name: str
    language: str
    created_at: int
    created_ns: int
    """Creation time in ns: the listing order (``created_at`` alone ties within a second)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Consent:
        data = json.loads(raw)
        return cls(
            id=data["id"], name=data["name"], language=data["language"],
            created_at=int(data["created_at"]), created_ns=int(data["created_ns"]),
        )


def voice_created_ns(voice: Voice) -> int:
    return int(voice.extra.get("created_ns", voice.created_at * 1_000_000_000))


def voice_to_bytes(voice: Voice) -> bytes:
    """The ``.npz`` bytes ``save_voice`` would write (one format on disk and in Redis)."""
    buf = io.BytesIO()
    meta = {
        "id": voice.id, "name": voice.name, "prompt_text": voice.prompt_text, "lookahead_pad": voice.lookahead_pad,
        "model_hash": voice.model_hash, "created_at": voice.created_at, "extra": voice.extra,
    }
    np.savez(
        buf,
        prompt_tokens=np.asarray(voice.prompt_tokens, np.int32),
        prompt_mel=np.asarray(voice.prompt_mel, np.float32),
        speaker_embedding=np.asarray(voice.speaker_embedding, np.float32),
        meta=np.array(json.dumps(meta)),
    )
    return buf.getvalue()


def voice_from_bytes(raw: bytes) -> Voice:
    return load_voice(io.BytesIO(raw))


@dataclass(frozen=True)
class Page:
    """One page of a cursor listing: items after the cursor, and whether more follow."""

    items: list
    has_more: bool


def page_after(ordered_ids: list[str], after: str | None, limit: int) -> tuple[list[str], bool]:
    """The ids following ``after`` (all, when ``after`` is None or unknown-but-valid), at most ``limit``."""
    start = 0
    if after is not None:
        try:
            start = ordered_ids.index(after) + 1
        except ValueError:
            start = len(ordered_ids)  # a deleted cursor: nothing after it we can place
    chunk = ordered_ids[start : start + limit]
    return chunk, start + limit < len(ordered_ids)


class VoiceStore(ABC):
    """Async CRUD over voices and consents. Methods take already-validated ids."""

    @abstractmethod
    async def put_voice(self, voice: Voice) -> None: ...

    @abstractmethod
    async def get_voice(self, voice_id: str) -> Voice | None: ...

    @abstractmethod
    async def has_voice(self, voice_id: str) -> bool: ...

    @abstractmethod
    async def delete_voice(self, voice_id: str) -> bool:
        """True when the voice existed (and is now gone)."""

    @abstractmethod
    async def voice_ids(self) -> list[str]:
        """All voice ids, oldest first."""

    @abstractmethod
    async def put_consent(self, consent: Consent, recording: bytes | None) -> None:
        """Create or replace the consent record (``recording`` None keeps the stored one)."""

    @abstractmethod
    async def get_consent(self, consent_id: str) -> Consent | None: ...

    @abstractmethod
    async def delete_consent(self, consent_id: str) -> bool: ...

    @abstractmethod
    async def consent_ids(self) -> list[str]:
        """All consent ids, oldest first."""

    async def aclose(self) -> None:
        return None

    async def list_voices(self, after: str | None, limit: int) -> Page:
        ids, has_more = page_after(await self.voice_ids(), after, limit)
        voices = [v for v in [await self.get_voice(i) for i in ids] if v is not None]
        return Page(voices, has_more)

    async def list_consents(self, after: str | None, limit: int) -> Page:
        ids, has_more = page_after(await self.consent_ids(), after, limit)
        consents = [c for c in [await self.get_consent(i) for i in ids] if c is not None]
        return Page(consents, has_more)


class LocalVoiceStore(VoiceStore):
    """A directory; file I/O runs in a worker thread so the event loop never blocks on the disk."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.voices_dir = self.root / "voices"
        self.consents_dir = self.root / "consents"

    def _voice_path(self, voice_id: str) -> Path:
        if not is_voice_id(voice_id):  # defence in depth: callers validate too
            raise ValueError(f"not a voice id: {voice_id!r}")
        return self.voices_dir / f"{voice_id}.npz"

    def _consent_path(self, consent_id: str, suffix: str = ".json") -> Path:
        if not is_consent_id(consent_id):
            raise ValueError(f"not a consent id: {consent_id!r}")
        return self.consents_dir / f"{consent_id}{suffix}"

    async def put_voice(self, voice: Voice) -> None:
        await asyncio.to_thread(save_voice, voice, self._voice_path(voice.id))

    async def get_voice(self, voice_id: str) -> Voice | None:
        path = self._voice_path(voice_id)

        def read() -> Voice | None:
            try:
                return load_voice(path)
            except FileNotFoundError:
                return None

        return await asyncio.to_thread(read)

    async def has_voice(self, voice_id: str) -> bool:
        return await asyncio.to_thread(self._voice_path(voice_id).is_file)

    async def delete_voice(self, voice_id: str) -> bool:
        return await asyncio.to_thread(_unlink, self._voice_path(voice_id))

    async def voice_ids(self) -> list[str]:
        def scan() -> list[str]:
            found = []
            for path in self.voices_dir.glob("voice_*.npz"):
                if is_voice_id(path.stem):
                    try:
                        found.append((load_voice(path), path.stem))
                    except (OSError, ValueError, KeyError):
                        continue  # half-deleted or foreign file: not listable
            found.sort(key=lambda vi: (voice_created_ns(vi[0]), vi[1]))
            return [voice_id for _, voice_id in found]

        return await asyncio.to_thread(scan)

    async def put_consent(self, consent: Consent, recording: bytes | None) -> None:
        def write() -> None:
            self.consents_dir.mkdir(parents=True, exist_ok=True)
            if recording is not None:
                _atomic_write(self._consent_path(consent.id, ".recording"), recording)
            _atomic_write(self._consent_path(consent.id), consent.to_json().encode())

        await asyncio.to_thread(write)

    async def get_consent(self, consent_id: str) -> Consent | None:
        path = self._consent_path(consent_id)

        def read() -> Consent | None:
            try:
                return Consent.from_json(path.read_bytes())
            except FileNotFoundError:
                return None

        return await asyncio.to_thread(read)

    async def delete_consent(self, consent_id: str) -> bool:
        def remove() -> bool:
            _unlink(self._consent_path(consent_id, ".recording"))
            return _unlink(self._consent_path(consent_id))

        return await asyncio.to_thread(remove)

    async def consent_ids(self) -> list[str]:
        def scan() -> list[str]:
            found = []
            for path in self.consents_dir.glob("cons_*.json"):
                if is_consent_id(path.stem):
                    try:
                        found.append(Consent.from_json(path.read_bytes()))
                    except (OSError, ValueError, KeyError):
                        continue
            found.sort(key=lambda c: (c.created_ns, c.id))
            return [c.id for c in found]

        return await asyncio.to_thread(scan)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class RedisVoiceStore(VoiceStore):
    """Redis keys (``prefix`` default ``tts:``): ``voice:<id>`` npz bytes, ``voices`` zset (score = created
    ns), ``consent:<id>`` JSON, ``consent_rec:<id>`` the recording, ``consents`` zset."""

    def __init__(self, url: str, prefix: str = "tts:") -> None:
        import redis.asyncio as aioredis  # the local store must not need redis installed

        self._redis = aioredis.from_url(url, decode_responses=False)
        self.prefix = prefix

    def _key(self, kind: str, item_id: str | None = None) -> str:
        if item_id is None:
            return f"{self.prefix}{kind}"
        valid = is_voice_id(item_id) if kind == "voice" else is_consent_id(item_id)
        if not valid:
            raise ValueError(f"not a {kind} id: {item_id!r}")
        return f"{self.prefix}{kind}:{item_id}"

    async def put_voice(self, voice: Voice) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._key("voice", voice.id), voice_to_bytes(voice))
            pipe.zadd(self._key("voices"), {voice.id: voice_created_ns(voice)})
            await pipe.execute()

    async def get_voice(self, voice_id: str) -> Voice | None:
        raw = await self._redis.get(self._key("voice", voice_id))
        return None if raw is None else await asyncio.to_thread(voice_from_bytes, raw)

    async def has_voice(self, voice_id: str) -> bool:
        return bool(await self._redis.exists(self._key("voice", voice_id)))

    async def delete_voice(self, voice_id: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("voice", voice_id))
            pipe.zrem(self._key("voices"), voice_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def voice_ids(self) -> list[str]:
        return [m.decode() for m in await self._redis.zrange(self._key("voices"), 0, -1)]

    async def put_consent(self, consent: Consent, recording: bytes | None) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._key("consent", consent.id), consent.to_json())
            if recording is not None:
                pipe.set(self._key("consent_rec", consent.id), recording)
            pipe.zadd(self._key("consents"), {consent.id: consent.created_ns})
            await pipe.execute()

    async def get_consent(self, consent_id: str) -> Consent | None:
        raw = await self._redis.get(self._key("consent", consent_id))
        return None if raw is None else Consent.from_json(raw)

    async def delete_consent(self, consent_id: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("consent", consent_id))
            pipe.delete(self._key("consent_rec", consent_id))
            pipe.zrem(self._key("consents"), consent_id)
            deleted, _, _ = await pipe.execute()
        return bool(deleted)

    async def consent_ids(self) -> list[str]:
        return [m.decode() for m in await self._redis.zrange(self._key("consents"), 0, -1)]

    async def aclose(self) -> None:
        await self._redis.aclose()


class CachedVoiceStore(VoiceStore):
    """A bounded LRU of decoded voices in front of another store (see the module docstring)."""

    def __init__(self, inner: VoiceStore, capacity: int = 256) -> None:
        self.inner = inner
        self.capacity = max(0, capacity)
        self._cache: OrderedDict[str, Voice] = OrderedDict()

    def _remember(self, voice: Voice) -> None:
        if self.capacity == 0:
            return
        self._cache[voice.id] = voice
        self._cache.move_to_end(voice.id)
        while len(self._cache) > self.capacity:
            self._cache.popitem(last=False)

    async def put_voice(self, voice: Voice) -> None:
        await self.inner.put_voice(voice)
        self._remember(voice)

    async def get_voice(self, voice_id: str) -> Voice | None:
        cached = self._cache.get(voice_id)
        if cached is not None:
            if await self.inner.has_voice(voice_id):
                self._cache.move_to_end(voice_id)
                return cached
            self._cache.pop(voice_id, None)
            return None
        voice = await self.inner.get_voice(voice_id)
        if voice is not None:
            self._remember(voice)
        return voice

    async def has_voice(self, voice_id: str) -> bool:
        return await self.inner.has_voice(voice_id)

    async def delete_voice(self, voice_id: str) -> bool:
        self._cache.pop(voice_id, None)
        return await self.inner.delete_voice(voice_id)

    async def voice_ids(self) -> list[str]:
        return await self.inner.voice_ids()

    async def put_consent(self, consent: Consent, recording: bytes | None) -> None:
        await self.inner.put_consent(consent, recording)

    async def get_consent(self, consent_id: str) -> Consent | None:
        return await self.inner.get_consent(consent_id)

    async def delete_consent(self, consent_id: str) -> bool:
        return await self.inner.delete_consent(consent_id)

    async def consent_ids(self) -> list[str]:
        return await self.inner.consent_ids()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __len__(self) -> int:
        return len(self._cache)


def store_from_settings(settings: Settings) -> CachedVoiceStore:
    """The configured backend (``voice_store``: ``local`` or ``redis``) behind the LRU cache."""
    inner: VoiceStore
    if settings.voice_store == "redis":
        inner = RedisVoiceStore(settings.redis_url, prefix=settings.redis_prefix)
    else:
        root = settings.voice_store_dir or str(Path(settings.voices_dir) / "custom")
        inner = LocalVoiceStore(root)
    return CachedVoiceStore(inner, capacity=settings.voice_cache_size)


def now_ns() -> int:
    return time.time_ns()
