"""Text normalization: numbers, dates, times, currencies, units and symbols read as words.

The speech-token LLM was trained on spoken-form text, so "$12.50 on 2024-03-05 at 10:30" must reach it
as "twelve dollars fifty cents on the fifth of march twenty twenty four at ten thirty". We use
WeTextProcessing's runtime (PyPI ``wetext``): its English and Chinese grammars ship as compiled FSTs,
it works offline and needs no torch (only ``kaldifst``).

Why it is wrapped the way it is:
- Cost. One call costs ~5-10 ms per sentence of CPU (FST composition), ~1 s for 4000 characters, so
  ``anormalize`` runs it in a worker thread and never on the event loop, and the pipeline normalizes
  only the head of a long input before the LLM starts (the tail in a thread while it generates).
- Robustness. The grammars raise on some inputs (e.g. "+1" or a sentence mixing Chinese and English
  with digits under the English grammar). We normalize sentence by sentence and keep a sentence as it
  was when its normalization fails, so one odd sentence never fails a request or loses the rest.
- Language. A sentence with CJK characters uses the Chinese grammar, any other the English one.
  Sentences without digits or symbols are left untouched (most prose: fast and exact).
- Whitespace. ``wetext`` strips and collapses whitespace; we keep each sentence's leading and
  trailing whitespace, so line breaks between sentences survive.
- Known English grammar slips are rewritten before it runs: "$12.50" (it reads "twelve point five
  dollars"), "1,234" (it drops the "one") and "1000" (it reads "ten hundred").
- Control tokens. The output never holds a ``<|`` or ``|>`` the input did not have: a sentence whose
  normalization would add one is kept as it was. (The prompt builder also neutralises such markers.)
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from typing import Any

from gateway.segment import split_sentences

log = logging.getLogger("gateway.normalize")

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
# What the grammars rewrite: digits (ASCII and full-width) and a few spoken symbols.
_NEEDS_WORK = re.compile(r"[0-9０-９$€£¥￥%‰&@#+=°§~]")
_MONEY_EN = re.compile(r"([$€£])\s?(\d+)\.(\d{2})\b")
_MONEY_UNITS = {"$": ("dollars", "cents"), "€": ("euros", "cents"), "£": ("pounds", "pence")}
_ONE_THOUSAND_GROUPED = re.compile(r"(?<![\d,.])1,(\d{3})(?!\d|[,.]\d)")
_ONE_THOUSAND = re.compile(r"(?<![\d,.])1000(?!\d|[,.]\d)")
_MARKERS = ("<|", "|>")


def _fix_english(text: str) -> str:
    """Rewrite the forms the English grammar gets wrong into forms it reads right."""

    def money(match: re.Match[str]) -> str:
        major, minor = _MONEY_UNITS[match.group(1)]
        cents = int(match.group(3))
        return f"{match.group(2)} {major}" + (f" {cents} {minor}" if cents else "")

    def thousand(match: re.Match[str]) -> str:
        rest = int(match.group(1))
        return "one thousand" + (f" {rest}" if rest else "")

    text = _MONEY_EN.sub(money, text)
    text = _ONE_THOUSAND_GROUPED.sub(thousand, text)
    return _ONE_THOUSAND.sub("one thousand", text)


def _adds_markers(before: str, after: str) -> bool:
    return any(after.count(m) > before.count(m) for m in _MARKERS)


class NormalizationStopped(Exception):
    """``TextNormalizer.normalize`` was stopped through its ``stop`` event: there is no result."""


class TextNormalizer:
    """Sentence-wise English/Chinese text normalization over ``wetext``; thread-safe, loaded lazily."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grammars: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        with self._lock:
            if self._grammars is None:
                from wetext import Normalizer  # imported lazily: ~1 s and 45 MB of FSTs

                grammars = {lang: Normalizer(lang=lang, operator="tn") for lang in ("en", "zh")}
                for lang, sample in (("en", "1"), ("zh", "1")):  # read the FSTs from disk now
                    grammars[lang].normalize(sample)
                self._grammars = grammars
            return self._grammars

    def warm(self) -> None:
        """Load the grammars (blocking; call from a thread at startup so the first request is fast)."""
        self._load()

    def normalize(self, text: str, stop: threading.Event | None = None) -> str:
        """Spoken form of ``text`` (blocking, CPU-bound: ~5-10 ms per sentence with numbers).

        ``stop``: checked between sentences; once set, raises ``NormalizationStopped`` (a thread cannot
        be cancelled, so a request that went away sets it to end its long normalization early).
        """
        spoken = []
        for sentence in split_sentences(text):
            if stop is not None and stop.is_set():
                raise NormalizationStopped
            spoken.append(self._sentence(sentence))
        return "".join(spoken)

    async def anormalize(self, text: str) -> str:
        """``normalize`` in a worker thread, so the event loop keeps serving other streams."""
        if not _NEEDS_WORK.search(text):
            return text
        return await asyncio.to_thread(self.normalize, text)

    def _sentence(self, sentence: str) -> str:
        core = sentence.strip()
        if not core or not _NEEDS_WORK.search(core):
            return sentence
        lead = sentence[: len(sentence) - len(sentence.lstrip())]
        trail = sentence[len(sentence.rstrip()) :]
        lang = "zh" if _CJK.search(core) else "en"
        try:
            spoken = self._load()[lang].normalize(_fix_english(core) if lang == "en" else core)
        except Exception as exc:  # noqa: BLE001 - grammar failures keep the sentence as written
            log.debug("normalization kept a sentence as written (%r): %r", exc, core[:80])
            return sentence
        if not spoken.strip() or _adds_markers(core, spoken):
            return sentence
        return lead + spoken + trail


_default: TextNormalizer | None = None


def default_normalizer() -> TextNormalizer:
    """The process-wide normalizer (the grammars are large: load them once)."""
    global _default
    if _default is None:
        _default = TextNormalizer()
    return _default
