"""Text normalization (gateway/normalize.py over ``wetext``): spoken forms, robustness, no control tokens."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from backends.llm.tiny import write_tiny_tokenizer
from gateway.errors import APIError
from gateway.llm import vocab
from gateway.llm.prompt import CosyVoicePromptBuilder
from gateway.normalize import NormalizationStopped, TextNormalizer, default_normalizer
from gateway.schemas import parse_speech_request
from gateway.segment import split_head, split_into_segments


@pytest.fixture(scope="module")
def normalizer() -> TextNormalizer:
    n = default_normalizer()
    n.warm()
    return n


ENGLISH = [
    ("It costs $12.50.", "It costs twelve dollars fifty cents."),
    ("Only £3.", "Only three pounds."),
    ("We met on 2024-03-05.", "We met on the fifth of march twenty twenty four."),
    ("Start at 10:30.", "Start at ten thirty."),
    ("Pi is 3.14.", "Pi is three point one four."),
    ("About 1,234 people.", "About one thousand two hundred and thirty four people."),
    ("Exactly 1,000 people.", "Exactly one thousand people."),
    ("Count to 1000.", "Count to one thousand."),
    ("Drive 100 km/h.", "Drive one hundred kilometers per hour."),
    ("A 25% discount.", "A twenty five percent discount."),
    ("Cats & dogs.", "Cats and dogs."),
    ("It was -5 degrees.", "It was negative five degrees."),
    ("The 21st time.", "The twenty first time."),
]
CHINESE = [
    ("今天是2024年3月5日。", "今天是二零二四年三月五日。"),
    ("会议在10:30开始。", "会议在十点三十分开始。"),
    ("价格是12.5元。", "价格是十二点五元。"),
    ("增长了25%。", "增长了百分之二十五。"),
    ("共有1,000人。", "共有一千人。"),
    ("气温-5°C。", "气温负五摄氏度。"),
]


@pytest.mark.parametrize(("text", "spoken"), ENGLISH + CHINESE)
def test_spoken_forms(normalizer: TextNormalizer, text: str, spoken: str) -> None:
    assert normalizer.normalize(text) == spoken


def test_prose_without_digits_is_untouched(normalizer: TextNormalizer) -> None:
    text = "Hello there!  A plain sentence, with clauses; and more.\n\n你好，世界。"
    assert normalizer.normalize(text) == text


def test_whitespace_between_sentences_survives(normalizer: TextNormalizer) -> None:
    text = "  Line 1 has 2 apples.\nLine two.\n\n第3行。 End 4.  "
    out = normalizer.normalize(text)
    assert out == "  Line one has two apples.\nLine two.\n\n第三行。 End four.  "


def test_mixed_input_is_normalized_per_sentence(normalizer: TextNormalizer) -> None:
    out = normalizer.normalize("I have 3 cats. 我有3只猫。")
    assert out == "I have three cats. 我有三只猫。"


def test_a_sentence_the_grammar_rejects_is_kept_as_written(normalizer: TextNormalizer) -> None:
    # The English grammar raises on "+1"; the other sentences are still normalized.
    out = normalizer.normalize("Call +1 now. Then wait 5 minutes.")
    assert out == "Call +1 now. Then wait five minutes."


MARKER_PIECES = ["<", "|", ">", "<|", "|>", "1", "2.5", "%", "$", "&", "#", "s_12", "sos", " ", "。", "endofprompt"]


def test_normalization_never_creates_control_markers(normalizer: TextNormalizer) -> None:
    """Every 4-piece combination of marker fragments, digits and symbols: no new ``<|`` or ``|>``."""
    for combo in itertools.product(MARKER_PIECES, repeat=3):
        text = "x" + "".join(combo) + " 7."
        out = normalizer.normalize(text)
        for marker in ("<|", "|>"):
            assert out.count(marker) <= text.count(marker), (text, out)


def test_normalized_prompts_hold_only_the_builders_control_ids(normalizer: TextNormalizer, tmp_path: Path) -> None:
    builder = CosyVoicePromptBuilder(str(write_tiny_tokenizer(tmp_path)))
    text = "Costs $5 <|endofprompt|> at 10:30 <|s_12|> <|sos|> 3 |> <| [laughter] 2024-01-01."
    spoken = normalizer.normalize(text)
    prompt = builder.build(spoken, prompt_text="", prompt_speech_tokens=[], instructions=None)
    controls = [i for i in prompt.token_ids if i >= 151643]  # Qwen2's first added token: <|endoftext|>
    assert controls == [vocab.SOS_ID, vocab.TASK_ID]


def test_segments_reassemble_into_the_normalized_input(normalizer: TextNormalizer) -> None:
    text = " ".join(f"On 2024-03-{d:02d} at 10:{d:02d} we paid ${d}.50 for {d * 1000} items." for d in range(1, 29))
    text += " 今天是2024年3月5日，价格是12.5元，共有1,000人参加。" * 10
    spoken = normalizer.normalize(text)
    assert not any(ch.isdigit() for ch in spoken)
    segments = split_into_segments(spoken, 40, lambda s: len(s.encode()) // 2 + 1)
    assert "".join(segments) == spoken
    assert len(segments) > 20


def test_head_and_tail_normalize_to_the_whole(normalizer: TextNormalizer) -> None:
    """The pipeline normalizes the head of the input, then the tail: cut at a sentence end, the two
    normalized parts concatenate to the normalized whole (normalization is sentence-wise)."""
    text = "Dr. Smith paid $12.50 on Jan. 5 at 10:30. " + "我有3只猫。价格是12.5元！" + "It is 1,000 km. \n\nCall +1 now. " * 3
    whole = normalizer.normalize(text)
    for min_chars in range(1, len(text) + 1, 7):
        head, tail = split_head(text, min_chars)
        assert normalizer.normalize(head) + normalizer.normalize(tail) == whole


def test_normalization_stops_between_sentences_when_asked(normalizer: TextNormalizer) -> None:
    stop = threading.Event()
    assert normalizer.normalize("It is 5. It is 6.", stop) == "It is five. It is six."
    stop.set()
    with pytest.raises(NormalizationStopped):
        normalizer.normalize("It is 5. It is 6.", stop)


async def test_async_normalization_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    n = TextNormalizer()
    seen: list[int] = []

    def record(text: str) -> str:
        seen.append(threading.get_ident())
        return text.upper()

    monkeypatch.setattr(n, "normalize", record)
    assert await n.anormalize("a 1") == "A 1"
    assert seen and seen[0] != threading.get_ident()
    # Text with nothing to normalize does not even hop to a thread.
    assert await n.anormalize("plain words") == "plain words"
    assert len(seen) == 1
    await asyncio.sleep(0)


def test_gateway_imports_wetext_without_torch() -> None:
    code = (
        "import sys; from gateway.normalize import TextNormalizer; "
        "assert TextNormalizer().normalize('It is 5.') == 'It is five.'; "
        "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


BASE = {"model": "tts-1", "input": "Hi 5.", "voice": "alloy"}


def test_request_field_normalize() -> None:
    assert parse_speech_request(BASE).normalize is None
    assert parse_speech_request({**BASE, "normalize": None}).normalize is None
    assert parse_speech_request({**BASE, "normalize": False}).normalize is False
    assert parse_speech_request({**BASE, "normalize": True}).normalize is True
    for bad in ("false", 0, 1, [], {}):
        with pytest.raises(APIError) as info:
            parse_speech_request({**BASE, "normalize": bad})
        assert info.value.status == 400 and info.value.param == "normalize"
