"""Time to first audio vs input length, text normalization on and off (not in CI; docs/benchmarks.md).

    .venv/bin/python deploy/local/ttfa.py                        # starts its own local stack
    .venv/bin/python deploy/local/ttfa.py --url http://127.0.0.1:8000

For a short and a long number-dense input in English and in Chinese, with the request field
``normalize`` true and false: POST /v1/audio/speech (``response_format: "pcm"``, voice ``alloy``)
with httpx and time from sending it to the first non-empty body chunk, then close the stream. One
warm-up request first, then ``--runs`` runs of each case in turn. Prints a Markdown table (seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def english(d: int) -> str:
    return f"On March {d}, 2024 the team met at 10:{d % 60:02d} to review {d} reports and a ${d},200 budget. "


def chinese(d: int) -> str:
    return f"2024年3月{d % 28 + 1}日上午10:{d % 60:02d}，团队在{d}号会议室开会审查了{d}份报告和{d},200元的预算。"


def text_of(sentence, chars: int) -> str:  # noqa: ANN001 - int -> str
    """Whole, distinct number-dense sentences up to about ``chars`` characters (at least one)."""
    text, d = sentence(5), 6
    while len(text + sentence(d)) <= chars:
        text, d = text + sentence(d), d + 1
    return text.strip()


CASES = [
    ("English", text_of(english, 80)),
    ("English", text_of(english, 3990)),
    ("Chinese", text_of(chinese, 100)),
    ("Chinese", text_of(chinese, 4000)),
]


def first_audio_s(client: httpx.Client, url: str, text: str, normalize: bool) -> float:
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm", "normalize": normalize}
    started = time.monotonic()
    with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            if chunk:
                return time.monotonic() - started
    raise RuntimeError("the response had no audio")


def measure(url: str, runs: int) -> list[tuple[str, int, bool, list[float]]]:
    rows = []
    with httpx.Client(timeout=300) as client:
        first_audio_s(client, url, CASES[0][1], True)  # warm-up
        for language, text in CASES:
            for normalize in (True, False):
                times = [first_audio_s(client, url, text, normalize) for _ in range(runs)]
                rows.append((language, len(text), normalize, times))
                print(f"{language} {len(text)} chars normalize={normalize}: {times}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[tuple[str, int, bool, list[float]]]) -> str:
    runs = len(rows[0][3])
    lines = ["| input | normalize | " + " | ".join(f"run {i + 1}" for i in range(runs)) + " | median |",
             "|---|---|" + "---|" * (runs + 1)]
    for language, chars, normalize, times in rows:
        cells = " | ".join(f"{t:.3f}" for t in times)
        lines.append(f"| {language}, {chars} chars | {'on' if normalize else 'off'} | {cells} | "
                     f"{statistics.median(times):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running gateway (default: start a local stack)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            sys.path.insert(0, str(ROOT))
            from backends.llm.vllm_launcher import free_port
            from deploy.local.stack import StackConfig, local_stack

            var = Path(tempfile.mkdtemp(prefix="tts-ttfa-"))
            stack.callback(shutil.rmtree, var, True)  # runs after the stack stopped
            cfg = StackConfig(var_dir=var, gateway_port=free_port(), llm_port=free_port(),
                              triton_http_port=free_port(), triton_grpc_port=free_port(),
                              triton_metrics_port=free_port())
            url = stack.enter_context(local_stack(cfg)).url
        print(f"load average before: {os.getloadavg()}", file=sys.stderr)
        rows = measure(url, args.runs)
        print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    print(table(rows))


if __name__ == "__main__":
    main()
