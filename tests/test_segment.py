"""Segmenting keeps every character, in order, and respects the token budget."""

import pytest

from gateway.segment import split_head, split_into_segments, split_sentences


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


@pytest.mark.parametrize(
    "text",
    [
        "Pi is 3.14 and e is 2.718.",
        "About 1,000,000 people came.",
        "We start at 10:30 sharp.",
        "Visit https://example.com/a?b=1&c=2 now.",
        "Dr. Smith and Mr. J. K. Rowling met on Jan. 5 in the U.S. office.",
        "See e.g. the report, i.e. the long one.",
    ],
)
def test_no_sentence_cut_inside_numbers_urls_or_after_abbreviations(text: str) -> None:
    assert split_sentences(text) == [text]


def test_cjk_sentences_need_no_space() -> None:
    assert split_sentences("你好。我们在测试！真的吗？是的；好") == ["你好。", "我们在测试！", "真的吗？", "是的；", "好"]


def test_sentence_ends_still_cut_after_ordinary_words() -> None:
    text = "He met Dr. Who. Then he left! Did he? Yes. 3.5 is a number. Done."
    assert split_sentences(text) == ["He met Dr. Who. ", "Then he left! ", "Did he? ", "Yes. ", "3.5 is a number. ", "Done."]


def test_a_long_sentence_is_cut_at_clause_boundaries_not_inside_numbers() -> None:
    text = "In 2024, we counted 1,000,000 birds, 3.14 kilometres away, at 10:30, near the lake, on a sunny day."
    segments = split_into_segments(text, 12, len)
    assert "".join(segments) == text
    assert all(len(s) <= 12 for s in segments)
    assert segments[0] == "In 2024, " and segments[-1].endswith("day.")
    for number in ("2024", "1,000,000", "3.14", "10:30"):
        assert any(number in s for s in segments)


def test_clauses_are_preferred_to_spaces() -> None:
    text = "first part of it, second part of it, third part of it."
    assert split_into_segments(text, 40, len) == ["first part of it, second part of it, ", "third part of it."]


def test_cjk_clause_punctuation_is_a_cut_point() -> None:
    text = "我们今天在这里测试，一个非常长的句子，它有很多的分句，每个分句都不长。"
    segments = split_into_segments(text, 12, len)
    assert segments == ["我们今天在这里测试，", "一个非常长的句子，", "它有很多的分句，", "每个分句都不长。"]


def test_an_unbroken_run_is_cut_between_cjk_characters_not_inside_a_number() -> None:
    text = "无标点的长中文2024年3月5日无标点的长中文"
    segments = split_into_segments(text, 8, len)
    assert "".join(segments) == text
    assert all(len(s) <= 8 for s in segments)
    assert any("2024" in s for s in segments)


@pytest.mark.parametrize("text", CASES + ["Dr. Smith came. He met Mr. J. K. Rowling on Jan. 5. " * 20])
@pytest.mark.parametrize("min_chars", [1, 30, 150, 10_000])
def test_head_is_whole_sentences_and_the_parts_split_like_the_whole(text: str, min_chars: int) -> None:
    head, tail = split_head(text, min_chars)
    assert head + tail == text and head
    assert len(head) >= min_chars or not tail
    # The cut is a sentence boundary of the whole text: the parts split into the whole's sentences.
    assert split_sentences(head) + (split_sentences(tail) if tail else []) == split_sentences(text)
    sentences = split_sentences(head)
    assert not tail or len(head) - len(sentences[-1]) < min_chars  # the fewest sentences that reach it
