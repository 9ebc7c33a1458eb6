"""Built-in voice entries from real material: wav + transcript pairs, or a CosyVoice ``spk2info.pt``.

Both write ``<voices_dir>/builtin/<name>.npz`` (``gateway.voices.save_voice``), which the gateway's
``VoiceRegistry`` loads at start-up; the gateway itself never unpickles anything.

* ``wavs SRC``: every ``SRC/<name>.<audio ext>`` (any container the API accepts), with the optional
  transcript ``SRC/<name>.txt``, goes through the same encoder as uploaded voices (same checks,
  same model hash). Name a file ``default`` to cover built-in names without their own file.
* ``spk2info PT``: a CosyVoice2 zero-shot speaker table (``add_zero_shot_spk`` entries:
  ``flow_prompt_speech_token`` [1, T], ``prompt_speech_feat`` [1, 2T, 80], ``flow_embedding``
  [1, 192], ``prompt_text`` as LLM token ids). Read with ``torch.load(weights_only=True)`` (no
  arbitrary pickles); the transcript is decoded with the LLM's ``tokenizer.json`` when given,
  else left empty (the voice is then used cross-lingually). Entries without prompt tokens
  (CosyVoice 1 SFT tables hold only an embedding) cannot drive zero-shot synthesis and are skipped.

``python -m backends.voices.import_presets wavs SRC --voices-dir var/voices --encoder-dir DIR``
``python -m backends.voices.import_presets spk2info spk2info.pt --voices-dir var/voices [--tokenizer-dir DIR]``
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from gateway.audio_decode import decode_upload
from gateway.voices import Voice, save_voice, validate_voice

AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".mp4", ".aac", ".webm")


def voice_from_audio(encoder: Any, name: str, audio: bytes, transcript: str = "") -> Voice:
    """One built-in entry from recorded bytes through ``backends.voices.encoder.VoiceEncoder``."""
    decoded = decode_upload(audio)
    prompt = encoder.encode(decoded.pcm_16k, decoded.pcm_24k)
    voice = Voice(
        id=name,
        name=name,
        prompt_text=transcript.strip(),
        prompt_tokens=prompt.prompt_tokens,
        prompt_mel=prompt.prompt_mel,
        speaker_embedding=prompt.speaker_embedding,
        lookahead_pad="silence",
        model_hash=prompt.model_hash,
    )
    validate_voice(voice)
    return voice


def import_wav_dir(src: str | Path, voices_dir: str | Path, encoder_dir: str | Path) -> list[Path]:
    from backends.voices.encoder import VoiceEncoder

    encoder = VoiceEncoder(encoder_dir)
    written = []
    for audio_path in sorted(p for p in Path(src).iterdir() if p.suffix.lower() in AUDIO_SUFFIXES):
        text_path = audio_path.with_suffix(".txt")
        transcript = text_path.read_text(encoding="utf-8") if text_path.is_file() else ""
        voice = voice_from_audio(encoder, audio_path.stem, audio_path.read_bytes(), transcript)
        out = Path(voices_dir) / "builtin" / f"{audio_path.stem}.npz"
        save_voice(voice, out)
        written.append(out)
    return written


def _array(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def voice_from_spk2info_entry(name: str, entry: dict, decode_text: Any = None, model_hash: str = "spk2info") -> Voice | None:
    """One entry, or None when it lacks what zero-shot synthesis needs."""
    tokens = entry.get("flow_prompt_speech_token", entry.get("llm_prompt_speech_token"))
    mel = entry.get("prompt_speech_feat")
    embedding = entry.get("flow_embedding", entry.get("llm_embedding", entry.get("embedding")))
    if tokens is None or mel is None or embedding is None:
        return None
    tokens_np = _array(tokens).reshape(-1).astype(np.int32)
    mel_np = _array(mel).reshape(-1, 80).astype(np.float32)
    token_len = min(tokens_np.size, mel_np.shape[0] // 2)
    text = ""
    prompt_text = entry.get("prompt_text")
    if decode_text is not None and prompt_text is not None:
        text = decode_text([int(i) for i in _array(prompt_text).reshape(-1)])
    elif isinstance(prompt_text, str):
        text = prompt_text
    voice = Voice(
        id=name,
        name=name,
        prompt_text=text,
        prompt_tokens=tokens_np[:token_len],
        prompt_mel=np.ascontiguousarray(mel_np[: 2 * token_len]),
        speaker_embedding=_array(embedding).reshape(-1).astype(np.float32),
        lookahead_pad="silence",
        model_hash=model_hash,
    )
    validate_voice(voice)
    return voice


def import_spk2info(pt_path: str | Path, voices_dir: str | Path, tokenizer_dir: str | Path | None = None) -> list[Path]:
    import hashlib

    import torch  # backends only: reading the table is the one step that needs it

    table = torch.load(str(pt_path), map_location="cpu", weights_only=True)
    decode_text = None
    if tokenizer_dir is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        decode_text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    model_hash = "spk2info:" + hashlib.sha256(Path(pt_path).read_bytes()).hexdigest()
    written = []
    for name, entry in table.items():
        voice = voice_from_spk2info_entry(str(name), entry, decode_text, model_hash)
        if voice is None:
            print(f"skipping {name!r}: no prompt speech tokens/feat (not a zero-shot entry)")
            continue
        out = Path(voices_dir) / "builtin" / f"{name}.npz"
        save_voice(voice, out)
        written.append(out)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    wavs = sub.add_parser("wavs")
    wavs.add_argument("src")
    wavs.add_argument("--voices-dir", required=True)
    wavs.add_argument("--encoder-dir", required=True)
    spk = sub.add_parser("spk2info")
    spk.add_argument("pt")
    spk.add_argument("--voices-dir", required=True)
    spk.add_argument("--tokenizer-dir")
    args = parser.parse_args()
    if args.kind == "wavs":
        written = import_wav_dir(args.src, args.voices_dir, args.encoder_dir)
    else:
        written = import_spk2info(args.pt, args.voices_dir, args.tokenizer_dir)
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
