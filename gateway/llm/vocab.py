"""The CosyVoice2 LLM vocabulary layout (ids only): shared by the tiny-model maker and the tests.

The numbers mirror the published CosyVoice2-0.5B Hugging Face export (ARCHITECTURE.md, "The models").
Lives in the gateway (no torch); the tiny-model maker in backends/llm imports it from here.
"""

from __future__ import annotations

#: Size of the Qwen2 byte-level BPE vocabulary: ids 0..151642.
BPE_VOCAB_SIZE = 151643

#: The 20 added tokens that follow the BPE ids, in id order from 151643.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)
SPECIAL_BASE_ID = BPE_VOCAB_SIZE
ENDOFTEXT_ID = 151643
ENDOFPROMPT_ID = 151646

#: Speech tokens <|s_0|>..<|s_6560|> (3^8 FSQ codes, 25 per second of audio).
SPEECH_TOKEN_COUNT = 6561
SPEECH_TOKEN_BASE_ID = 151663  # "ORIGINAL_VOCAB_SIZE" upstream

EOS1_ID = 158224
EOS2_ID = 158225
EOS3_ID = 158226
SOS_ID = 158227
TASK_ID = 158228
EOS_IDS: tuple[int, ...] = (EOS1_ID, EOS2_ID, EOS3_ID)

#: The tokens after the speech tokens, in id order from 158224.
TAIL_TOKENS: tuple[str, ...] = ("<|eos1|>", "<|eos2|>", "<|eos3|>", "<|sos|>", "<|task_id|>")

#: Rows of the embedding / lm_head matrices (padded past the last real id).
PADDED_VOCAB_SIZE = 158336


def speech_token_text(s: int) -> str:
    """The added-token text of speech token ``s`` (0..6560)."""
    return f"<|s_{s}|>"


def all_added_tokens() -> list[tuple[int, str]]:
    """Every added token as (id, text), ids 151643..158228 in order."""
    tokens = [(SPECIAL_BASE_ID + i, t) for i, t in enumerate(SPECIAL_TOKENS)]
    tokens += [(SPEECH_TOKEN_BASE_ID + s, speech_token_text(s)) for s in range(SPEECH_TOKEN_COUNT)]
    tokens += [(EOS1_ID + i, t) for i, t in enumerate(TAIL_TOKENS)]
    return tokens
