"""Segmenting keeps every character, in order, and respects the token budget."""

import pytest

from gateway.segment import split_into_segments, split_sentences


def utf8_tokens(text: str) -> int:
    """A stand-in token count: one token per 3 UTF-8 bytes, like a byte-level BPE with few merges."""
    return (len(text.encode()) + 2) // 3


CASES = [
    "Hello there. This is a test! Is it? Yes; it is… done",
    "你好。我们在测试，一个很长的句子。第二句！第三句？",
    "Mixed English 和中文 text, with clauses: many of them — and numbers like 3.14 and 1,000,000.",
    "é" * 4096,
    "word " * 800,
    "无标点的长中文" * 300,
    "line one\nline two\n\nline three\n",
]


@pytest.mark.parametrize("text", CASES)
@pytest.mark.parametrize("budget", [5, 40, 83])
def test_segments_reassemble_and_fit(text: str, budget: int) -> None:
    segments = split_into_segments(text, budget, utf8_tokens)
    assert "".join(segments) == text
    assert all(utf8_tokens(s) <= budget for s in segments)
    assert all(segments)


def test_cuts_prefer_sentence_ends() -> None:
    text = "First sentence here. Second sentence here. Third one."
    segments = split_into_segments(text, utf8_tokens("First sentence here. Second"), utf8_tokens)
    assert segments[0] == "First sentence here. "


def test_numbers_are_not_cut_at_their_dot() -> None:
    assert split_sentences("Pi is 3.14 exactly. Next.") == ["Pi is 3.14 exactly. ", "Next."]


def test_budget_must_be_positive() -> None:
    with pytest.raises(ValueError):
        split_into_segments("abc", 0, utf8_tokens)
