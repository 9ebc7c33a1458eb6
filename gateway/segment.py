"""Cut an input into segments that each fit the LLM's context.

One segment is one LLM completion and one token2wav stream. The LLM's prompt holds the voice prompt,
the segment's text and up to 20 speech tokens per text token of output, so the text budget per
segment is small (~80 tokens with a 10 s voice prompt in a 2048-token context). We cut at sentence
ends first, then at clause punctuation, then at spaces, and only as a last resort inside a run of
characters. Concatenating the segments gives back the input exactly: nothing is lost or reordered.

No cut inside a word or number: Latin punctuation only ends a sentence or clause when whitespace
follows it, so "3.14", "1,000", "10:30", "e.g" inside "https://x.org/a?b=1" stay whole; a period after
a known abbreviation ("Dr.", "e.g.", "Jan.") or a single initial ("J. K. Rowling") does not end a
sentence. CJK punctuation needs no following space. The last-resort cut of an unbroken run lands
between two characters that are not both Latin letters/digits (between CJK characters, say).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

# A sentence ends after terminal punctuation (plus closing quotes/brackets) and the whitespace after it.
# CJK terminators need no following space.
_SENTENCE_END = re.compile(r"""(?:[.!?;…]+["'”’)\]]*\s+|[。！？；]+["'”’）」』]*\s*|\n+)""")
_CLAUSE_END = re.compile(r"""(?:[,:]+["'”’)\]]*\s+|[，、：]+["'”’）」』]*\s*|\s*[—–]+\s*)""")
_SPACE = re.compile(r"\s+")


def _cut_after(text: str, pattern: re.Pattern[str]) -> list[str]:
    """Split ``text`` right after each match of ``pattern``; the pieces concatenate to ``text``."""
    pieces: list[str] = []
    start = 0
    for match in pattern.finditer(text):
        if match.end() > start:
            pieces.append(text[start : match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


# Words after which a period usually does not end the sentence (compared lower-case, without the dot).
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt ft vs etc e.g i.e cf no nos vol fig approx dept est inc ltd co corp "
    "jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun u.s u.k a.m p.m".split()
)
_LAST_WORD = re.compile(r"""(\S+?)\.["'”’)\]]*\s+$""")


def _ends_with_abbreviation(piece: str) -> bool:
    match = _LAST_WORD.search(piece)
    if match is None:
        return False
    word = match.group(1).lstrip("(\"'“‘[")
    return word.lower() in _ABBREVIATIONS or (len(word) == 1 and word.isalpha() and word.isupper())


def split_sentences(text: str) -> list[str]:
    """Sentences (with their trailing whitespace) whose concatenation is ``text``."""
    sentences: list[str] = []
    for piece in _cut_after(text, _SENTENCE_END):
        if sentences and _ends_with_abbreviation(sentences[-1]) and not sentences[-1].endswith("\n"):
            sentences[-1] += piece
        else:
            sentences.append(piece)
    return sentences


def split_head(text: str, min_chars: int) -> tuple[str, str]:
    """``(head, tail)``: the fewest whole sentences from the start holding ``min_chars`` characters, and
    the rest (``head + tail == text``; ``tail`` is empty when the text is short).

    The pipeline prepares the head first so the LLM starts while the tail is still being normalized.
    The cut is one of ``split_sentences``'s, so each part splits into exactly the sentences the whole
    text does, and sentence-wise work (normalization) over the parts gives what it gives over the whole.
    """
    length = 0
    for sentence in split_sentences(text):
        length += len(sentence)
        if length >= min_chars:
            return text[:length], text[length:]
    return text, ""


def _is_word_char(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch in "._-',:")


def _rough_cut(piece: str) -> int:
    """Where to halve an unbroken run: nearest the middle, not between two Latin letters/digits."""
    middle = len(piece) // 2
    for offset in range(middle):
        for at in (middle - offset, middle + offset + 1):
            if 0 < at < len(piece) and not (_is_word_char(piece[at - 1]) and _is_word_char(piece[at])):
                return at
    return middle


def _fit(piece: str, budget: int, count: Callable[[str], int]) -> Iterator[str]:
    """Yield sub-pieces of ``piece`` no longer than ``budget`` tokens, cutting at the gentlest boundary."""
    if count(piece) <= budget:
        yield piece
        return
    for pattern in (_CLAUSE_END, _SPACE):
        parts = _cut_after(piece, pattern)
        if len(parts) > 1:
            yield from _pack(parts, budget, count)
            return
    # One unbroken run (e.g. CJK without punctuation): halve it until it fits.
    middle = _rough_cut(piece)
    yield from _fit(piece[:middle], budget, count)
    yield from _fit(piece[middle:], budget, count)


def _pack(pieces: list[str], budget: int, count: Callable[[str], int]) -> Iterator[str]:
    """Greedily join consecutive pieces while the joined text stays within ``budget`` tokens."""
    current = ""
    for piece in pieces:
        for part in _fit(piece, budget, count):
            if current and count(current + part) > budget:
                yield current
                current = part
            else:
                current += part
    if current:
        yield current


def split_into_segments(text: str, max_tokens: int, count_tokens: Callable[[str], int]) -> list[str]:
    """Segments of at most ``max_tokens`` text tokens whose concatenation is ``text``.

    Segments that hold only whitespace/punctuation-free blanks are merged into their neighbours by
    construction (they never start a segment on their own unless the text is blank).
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be positive")
    segments = list(_pack(split_sentences(text), max_tokens, count_tokens))
    # A trailing segment of pure whitespace has nothing to say; fold it into the previous one's text.
    while len(segments) > 1 and not segments[-1].strip():
        tail = segments.pop()
        segments[-1] += tail
    return segments
