"""Download one model folder from Hugging Face or ModelScope into place, atomically.

``llm``: the whole repository (CosyVoice2 LLM in Hugging Face Qwen2 format: config, safetensors,
tokenizer). ``token2wav``: only the ``token2wav/`` folder of the Step-Audio-2 repository (flow.yaml,
flow.pt, hift.pt, campplus.onnx, speech_tokenizer_v2_25hz.onnx), not the multi-GB audio LLM beside it.

Files land in ``<out>.partial`` first and are renamed at the end, so an interrupted run never leaves a
folder that the next run's "already there" check would accept.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

TOKEN2WAV_SUBDIR = "token2wav"
TOKEN2WAV_FILES = ("flow.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2_25hz.onnx")
LLM_FILES = ("config.json", "tokenizer.json")


def snapshot(source: str, repo: str, revision: str, target: Path, patterns: list[str] | None) -> None:
    """Fetch ``repo`` (files matching ``patterns``) into ``target`` with the source's own client."""
    if source == "huggingface":
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=repo, revision=revision, local_dir=str(target), allow_patterns=patterns,
                          token=os.environ.get("HF_TOKEN") or None)
    elif source == "modelscope":
        from modelscope import snapshot_download as ms_snapshot_download

        ms_snapshot_download(repo, revision=None if revision == "main" else revision, local_dir=str(target),
                             allow_patterns=patterns)
    else:
        raise SystemExit(f"unknown MODEL_SOURCE {source!r}: use huggingface or modelscope")


def require(folder: Path, names: tuple[str, ...], what: str) -> None:
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise SystemExit(f"{what}: {folder} lacks {missing}; check the repository and revision")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["llm", "token2wav"])
    parser.add_argument("--repo", required=True)
    parser.add_argument("--revision", default="main")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", default=os.environ.get("MODEL_SOURCE", "huggingface"))
    args = parser.parse_args()

    partial = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if args.kind == "llm":
        snapshot(args.source, args.repo, args.revision, partial, None)
        folder, expected = partial, LLM_FILES
    else:
        snapshot(args.source, args.repo, args.revision, partial, [f"{TOKEN2WAV_SUBDIR}/*"])
        folder, expected = partial / TOKEN2WAV_SUBDIR, TOKEN2WAV_FILES
    require(folder, expected, args.kind)
    shutil.rmtree(args.out, ignore_errors=True)
    folder.rename(args.out)
    shutil.rmtree(partial, ignore_errors=True)


if __name__ == "__main__":
    main()
