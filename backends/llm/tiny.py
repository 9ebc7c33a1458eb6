"""A tiny random-weight stand-in for the CosyVoice2 speech-token LLM, in the published HF Qwen2 layout.

Why: the real model (0.5 B) is slow on CPU and not something CI can download. The tests and the local
stack need something that a real vLLM server loads exactly like the real folder (same file names,
same vocabulary ids, same prompt token ids) and that *behaves* like it at the protocol level: it emits
speech tokens and, eventually, an end-of-speech token.

What is rigged, and how (numbers measured/calibrated at generation time, not trained):
- every embedding row carries a constant "anchor" value in channel 0, so after the final RMSNorm the
  hidden state always points roughly the same way in that channel;
- the lm_head gives speech-token rows a positive weight on the anchor channel (plus a little noise and
  random weights on the other channels, so which speech token wins depends on the context), every
  other row a negative one: sampled tokens are speech tokens;
- ``<|eos1|>``'s anchor weight is calibrated by bisection so that, under the upstream sampling
  defaults (temperature 0.8, top_k 50, top_p 0.95), it is drawn with probability ~``EOS_PROBABILITY``
  per step: utterances end after ~1/p tokens, geometrically distributed, like a real (if short) one.
- attention/MLP output projections are small, so the layers perturb but do not swamp the anchor.

Generated at test time into a temporary folder (~81 MB fp32, a few seconds); never committed.
CLI: ``python -m backends.llm.tiny OUT_DIR [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from gateway.llm import vocab

HIDDEN_SIZE = 64
HEAD_DIM = 64  # vLLM's CPU attention kernels need head_dim 64 (or a multiple of 16 >= 64)
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 128
MAX_POSITIONS = 4096
EOS_PROBABILITY = 0.02

ANCHOR_VALUE = 4.0  # channel 0 of every embedding row
EMBED_STD = 0.5  # the other channels
# Qwen2's pre-tokenizer split pattern (published tokenizer.json); mirrored so that text is cut into
# words the same way the real tokenizer cuts it.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE, in byte order (printable bytes map to themselves)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars: list[str] = []
    shifted = 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def build_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer with exactly the CosyVoice2 id layout.

    Ids 0..255 are the 256 byte symbols (so any text encodes), 256..151642 are inert filler entries
    (the real merges are not needed: only the id layout matters), then the added tokens at their
    published ids. No merges: every byte of text is one token, which keeps expected ids easy to derive.
    """
    alphabet = _byte_level_alphabet()
    bpe_vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(len(alphabet), vocab.BPE_VOCAB_SIZE):
        bpe_vocab[f"<filler_{i}>"] = i
    tokenizer = Tokenizer(models.BPE(vocab=bpe_vocab, merges=[]))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()

    # Three batches in id order (one call each: adding thousands one by one rebuilds the matcher each time).
    # The s-tokens are ordinary added tokens (they survive skip_special_tokens); the rest are special.
    specials = [AddedToken(t, special=True, normalized=False) for t in vocab.SPECIAL_TOKENS]
    speech = [
        AddedToken(vocab.speech_token_text(s), special=False, normalized=False) for s in range(vocab.SPEECH_TOKEN_COUNT)
    ]
    tail = [AddedToken(t, special=True, normalized=False) for t in vocab.TAIL_TOKENS]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(speech)
    tokenizer.add_special_tokens(tail)
    for token_id, text in vocab.all_added_tokens():
        if tokenizer.token_to_id(text) != token_id:
            raise AssertionError(f"{text!r} got id {tokenizer.token_to_id(text)}, expected {token_id}")
    return tokenizer


def write_tiny_tokenizer(path: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``path``."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save(str(out / "tokenizer.json"))
    eot = vocab.SPECIAL_TOKENS[0]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eot,
                "pad_token": eot,
                "bos_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 2048,
            },
            indent=2,
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eot, "pad_token": eot}, indent=2))
    return out


def _rms_norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _eos_probability(anchor_weight: float, hidden: np.ndarray, top_speech_logits: np.ndarray) -> float:
    """Mean probability of drawing eos1 under temperature 0.8 / top_k 50 / top_p 0.95, given each
    hidden state's 50 best speech-token logits (only those can compete with eos inside top_k 50)."""
    eos_logits = hidden[:, 0:1] * anchor_weight
    logits = np.concatenate([top_speech_logits, eos_logits], axis=1) / 0.8
    order = np.argsort(-logits, axis=1)[:, :50]
    top = np.take_along_axis(logits, order, axis=1)
    probs = np.exp(top - top[:, :1])
    probs /= probs.sum(axis=1, keepdims=True)
    # top_p: keep the smallest prefix whose mass reaches 0.95
    keep = np.cumsum(probs, axis=1) - probs < 0.95
    kept = np.where(keep, probs, 0.0)
    kept /= kept.sum(axis=1, keepdims=True)
    is_eos = order == logits.shape[1] - 1
    return float((kept * is_eos).sum(axis=1).mean())


def _rigged_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    v, h = vocab.PADDED_VOCAB_SIZE, HIDDEN_SIZE
    f32 = np.float32

    embed = rng.normal(0.0, EMBED_STD, size=(v, h)).astype(f32)
    embed[:, 0] = ANCHOR_VALUE

    speech = slice(vocab.SPEECH_TOKEN_BASE_ID, vocab.SPEECH_TOKEN_BASE_ID + vocab.SPEECH_TOKEN_COUNT)
    lm_head = np.zeros((v, h), dtype=f32)
    lm_head[:, 0] = -1.0
    n_speech = vocab.SPEECH_TOKEN_COUNT
    lm_head[speech, 0] = 1.0 + 0.1 * rng.normal(size=n_speech)
    lm_head[speech, 1:] = rng.normal(0.0, 0.15, size=(n_speech, h - 1))

    # Calibrate eos1 against hidden states like the ones the model sees while speaking.
    sample_rows = rng.integers(vocab.SPEECH_TOKEN_BASE_ID, vocab.SPEECH_TOKEN_BASE_ID + n_speech, size=256)
    hidden = _rms_norm(embed[sample_rows].astype(np.float64))
    speech_logits = hidden @ lm_head[speech].T.astype(np.float64)
    top_speech_logits = -np.partition(-speech_logits, 49, axis=1)[:, :50]
    low, high = 0.0, 3.0
    for _ in range(40):
        mid = (low + high) / 2
        if _eos_probability(mid, hidden, top_speech_logits) < EOS_PROBABILITY:
            low = mid
        else:
            high = mid
    lm_head[vocab.EOS1_ID, 0] = (low + high) / 2

    weights: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    weights["model.norm.weight"] = np.ones(h, dtype=f32)
    q_size = HEAD_DIM  # one attention head, one kv head
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = np.ones(h, dtype=f32)
        weights[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=f32)
        for name in ("q_proj", "k_proj", "v_proj"):
            weights[p + f"self_attn.{name}.weight"] = rng.normal(0.0, 0.1, size=(q_size, h)).astype(f32)
            weights[p + f"self_attn.{name}.bias"] = np.zeros(q_size, dtype=f32)
        weights[p + "self_attn.o_proj.weight"] = rng.normal(0.0, 0.01, size=(h, q_size)).astype(f32)
        weights[p + "mlp.gate_proj.weight"] = rng.normal(0.0, 0.1, size=(INTERMEDIATE_SIZE, h)).astype(f32)
        weights[p + "mlp.up_proj.weight"] = rng.normal(0.0, 0.1, size=(INTERMEDIATE_SIZE, h)).astype(f32)
        weights[p + "mlp.down_proj.weight"] = rng.normal(0.0, 0.01, size=(h, INTERMEDIATE_SIZE)).astype(f32)
    return weights


def _config() -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab.PADDED_VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": HIDDEN_SIZE // HEAD_DIM,
        "num_key_value_heads": HIDDEN_SIZE // HEAD_DIM,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "bos_token_id": vocab.ENDOFTEXT_ID,
        "eos_token_id": vocab.ENDOFTEXT_ID,
        "torch_dtype": "float32",
    }


def write_tiny_llm(path: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny CosyVoice2-layout LLM folder into ``path`` and return it."""
    out = write_tiny_tokenizer(path)
    (out / "config.json").write_text(json.dumps(_config(), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": vocab.ENDOFTEXT_ID,
                "eos_token_id": list(vocab.EOS_IDS),
                "do_sample": True,
                "temperature": 0.8,
                "top_p": 0.95,
                "top_k": 50,
                "repetition_penalty": 1.1,
            },
            indent=2,
        )
    )
    save_file(_rigged_weights(np.random.default_rng(seed)), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_llm(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
