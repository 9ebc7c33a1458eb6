"""CosyVoice2 LLM prompts as token ids: zero-shot, cross-lingual and instruct.

The prompt is sent to the server as token ids (never as text), so the server's own tokenizer and
special-token parsing never see user text. The forms (ARCHITECTURE.md, "The models"):

- zero-shot:     <|sos|> + tokens(prompt_text) + tokens(text) + <|task_id|> + (151663 + prompt speech tokens)
- cross-lingual: <|sos|> + tokens(text) + <|task_id|>                 (voice without transcript: no speech prefix)
- instruct:      <|sos|> + tokens(instructions) + <|endofprompt|> + tokens(text) + <|task_id|>   (no speech prefix)

As upstream, the prompt text and the input text are tokenized separately and concatenated.

Control-token neutralising: user text (input, transcript, instructions) is tokenized with the BPE model
alone, bypassing the tokenizer's added-token matcher: the text is normalised and pre-tokenized exactly
as the full tokenizer would, then each piece goes through ``tokenizer.model.tokenize``. Markers such as
``<|sos|>``, ``<|s_12|>``, ``<|endofprompt|>`` or ``[laughter]`` therefore become the ordinary byte-level
tokens of their characters (as if the user had typed them in a word processor), never their control
ids. For text without markers the ids are identical to ``tokenizer.encode``. The only control ids in a
prompt are the ones this module puts there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from gateway.llm import vocab

#: CosyVoice bounds on the number of generated speech tokens, per input-text token.
MAX_TOKENS_PER_TEXT_TOKEN = 20
MIN_TOKENS_PER_TEXT_TOKEN = 2

MODE_ZERO_SHOT = "zero_shot"
MODE_CROSS_LINGUAL = "cross_lingual"
MODE_INSTRUCT = "instruct"


@dataclass
class LLMPrompt:
    """One completion request's prompt and length bounds."""

    token_ids: list[int]
    text_token_count: int
    """Tokens of the input text alone (what the length bounds are computed from)."""
    max_tokens: int
    """At most this many speech tokens: 20 x text tokens, capped by what is left of the context."""
    min_tokens: int
    """At least this many before eos is accepted: 2 x text tokens (capped by max_tokens)."""
    mode: str
    """"zero_shot", "cross_lingual" or "instruct"."""


class PromptTooLong(ValueError):
    """The prompt leaves no room in the LLM context for any speech tokens."""


class CosyVoicePromptBuilder:
    """Builds CosyVoice2 prompts from the LLM folder's own tokenizer.json (no transformers, no torch)."""

    def __init__(self, tokenizer_dir: str, *, context_tokens: int = 2048) -> None:
        path = Path(tokenizer_dir)
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.context_tokens = context_tokens
        self._check_layout()

    def _check_layout(self) -> None:
        """Refuse a tokenizer whose control ids differ from the CosyVoice2 layout (wrong LLM folder)."""
        expected = {
            "<|sos|>": vocab.SOS_ID,
            "<|task_id|>": vocab.TASK_ID,
            "<|endofprompt|>": vocab.ENDOFPROMPT_ID,
            "<|eos1|>": vocab.EOS1_ID,
            vocab.speech_token_text(0): vocab.SPEECH_TOKEN_BASE_ID,
        }
        for text, token_id in expected.items():
            got = self._tokenizer.token_to_id(text)
            if got != token_id:
                raise ValueError(f"tokenizer maps {text!r} to {got}, CosyVoice2 needs {token_id}")

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: control-token markers are not recognised (see module doc)."""
        if not text:
            return []
        normalizer = self._tokenizer.normalizer
        normalized = normalizer.normalize_str(text) if normalizer is not None else text
        pre_tokenizer = self._tokenizer.pre_tokenizer
        pieces = [p for p, _ in pre_tokenizer.pre_tokenize_str(normalized)] if pre_tokenizer is not None else [normalized]
        model = self._tokenizer.model
        ids: list[int] = []
        for piece in pieces:
            ids.extend(token.id for token in model.tokenize(piece))
        return ids

    def count_tokens(self, text: str) -> int:
        """How many LLM tokens ``text`` takes (as plain text): the unit of the length bounds."""
        return len(self.encode_plain(text))

    def build(
        self,
        text: str,
        *,
        prompt_text: str = "",
        prompt_speech_tokens: Sequence[int] = (),
        instructions: str | None = None,
    ) -> LLMPrompt:
        """The prompt for one text segment. Mode: instruct if ``instructions``; zero-shot if the voice has
        both a transcript and speech tokens; cross-lingual otherwise (its speech tokens, if any, then
        only condition token2wav, as upstream)."""
        text_ids = self.encode_plain(text)
        if not text_ids:
            raise ValueError("text is empty")
        if instructions is not None and instructions.strip():
            mode = MODE_INSTRUCT
            prefix = self.encode_plain(instructions) + [vocab.ENDOFPROMPT_ID]
            speech_ids: list[int] = []
        elif prompt_text and len(prompt_speech_tokens) > 0:
            mode = MODE_ZERO_SHOT
            prefix = self.encode_plain(prompt_text)
            speech_ids = [vocab.SPEECH_TOKEN_BASE_ID + _checked_speech_token(s) for s in prompt_speech_tokens]
        else:
            mode = MODE_CROSS_LINGUAL
            prefix = []
            speech_ids = []
        token_ids = [vocab.SOS_ID, *prefix, *text_ids, vocab.TASK_ID, *speech_ids]

        room = self.context_tokens - len(token_ids)
        if room <= 0:
            raise PromptTooLong(f"prompt takes {len(token_ids)} of {self.context_tokens} context tokens")
        max_tokens = min(MAX_TOKENS_PER_TEXT_TOKEN * len(text_ids), room)
        min_tokens = min(MIN_TOKENS_PER_TEXT_TOKEN * len(text_ids), max_tokens)
        return LLMPrompt(
            token_ids=token_ids,
            text_token_count=len(text_ids),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            mode=mode,
        )

    def max_text_tokens(self, prefix_tokens: int) -> int:
        """The largest text token count whose 20x output still fits the context beside a prefix of
        ``prefix_tokens`` (sos + prompt text/instructions + task_id + speech prefix): for segmenting."""
        return max(0, math.floor((self.context_tokens - prefix_tokens) / (MAX_TOKENS_PER_TEXT_TOKEN + 1)))


def _checked_speech_token(s: int) -> int:
    s = int(s)
    if not 0 <= s < vocab.SPEECH_TOKEN_COUNT:
        raise ValueError(f"prompt speech token {s} outside 0..{vocab.SPEECH_TOKEN_COUNT - 1}")
    return s
