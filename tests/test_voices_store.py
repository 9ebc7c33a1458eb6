"""The voice store's own rules: bounded LRU, deletes seen through the cache, ids never become paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway.voice_store import (
    CachedVoiceStore,
    Consent,
    LocalVoiceStore,
    new_consent_id,
    new_voice_id,
    page_after,
)
from gateway.voices import Voice


def make_voice(voice_id: str, created_ns: int) -> Voice:
    rng = np.random.default_rng(created_ns)
    return Voice(
        id=voice_id, name="v", prompt_text="", prompt_tokens=rng.integers(0, 6561, 10, dtype=np.int32),
        prompt_mel=rng.normal(size=(20, 80)).astype(np.float32), speaker_embedding=rng.normal(size=192).astype(np.float32),
        created_at=created_ns // 10**9, extra={"created_ns": created_ns},
    )


async def test_lru_is_bounded_and_deletes_elsewhere_are_seen(tmp_path: Path) -> None:
    shared = LocalVoiceStore(tmp_path)
    a, b = CachedVoiceStore(shared, capacity=2), CachedVoiceStore(LocalVoiceStore(tmp_path), capacity=2)
    ids = [new_voice_id() for _ in range(3)]
    for i, voice_id in enumerate(ids):
        await a.put_voice(make_voice(voice_id, 10**18 + i))
    assert len(a) == 2  # the oldest was evicted
    assert (await a.get_voice(ids[0])).id == ids[0]  # still in the backend
    assert (await b.get_voice(ids[1])).id == ids[1] and len(b) == 1
    assert await a.delete_voice(ids[1]) is True
    assert await b.get_voice(ids[1]) is None and len(b) == 0  # b's cached copy is dropped, not served
    assert await a.delete_voice(ids[1]) is False
    assert await a.voice_ids() == [ids[0], ids[2]]  # oldest first


async def test_ids_are_checked_before_they_touch_a_path(tmp_path: Path) -> None:
    store = LocalVoiceStore(tmp_path)
    for bad in ("../x", "voice_" + "g" * 32, "voice_" + "0" * 31, "cons_" + "0" * 32):
        with pytest.raises(ValueError):
            await store.get_voice(bad)
    with pytest.raises(ValueError):
        await store.get_consent("../../etc/passwd")
    assert new_voice_id() != new_voice_id() and len(new_consent_id()) == 37


async def test_consents_persist_update_and_page(tmp_path: Path) -> None:
    store = LocalVoiceStore(tmp_path)
    consents = [Consent(new_consent_id(), f"c{i}", "en", 1, 10**18 + i) for i in range(5)]
    for c in consents:
        await store.put_consent(c, b"audio")
    renamed = Consent(consents[0].id, "renamed", "en", 1, consents[0].created_ns)
    await store.put_consent(renamed, None)
    reopened = LocalVoiceStore(tmp_path)
    assert await reopened.get_consent(consents[0].id) == renamed
    assert (tmp_path / "consents" / f"{consents[0].id}.recording").read_bytes() == b"audio"  # kept on update
    page = await reopened.list_consents(consents[1].id, 2)
    assert [c.id for c in page.items] == [consents[2].id, consents[3].id] and page.has_more
    assert page_after(["a", "b"], "b", 5) == ([], False) and page_after(["a", "b"], None, 1) == (["a"], True)
