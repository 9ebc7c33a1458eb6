"""Soak test (not in CI): mixed traffic against the gateway for N minutes, recording its RSS and open
file descriptors, to catch leaks that short tests cannot see.

    .venv/bin/python deploy/local/soak.py --minutes 30              # starts its own local stack
    .venv/bin/python deploy/local/soak.py --url http://127.0.0.1:8000 --pid 12345 --minutes 30

Traffic (``--concurrency`` workers, each picking at random): whole requests in every format, SSE,
streams abandoned before the first byte / mid-audio / during SSE, client errors (bad JSON, unknown
voice, bad field) and model listings. Every ``--sample-s`` seconds the gateway process's RSS
(``/proc/PID/status``) and open fds (``/proc/PID/fd``) are recorded. The summary compares the first
and last quarter of the run: growth over ``--max-rss-growth-mib`` MiB or ``--max-fd-growth`` fds
fails (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TEXTS = ("Hello there.", "How are you today?", "The quick brown fox jumps over the lazy dog.",
         "Numbers like 42 and dates like 2024-05-01 are read too.")


@dataclass
class Sample:
    t: float
    rss_mib: float
    fds: int


@dataclass
class Run:
    outcomes: Counter[str] = field(default_factory=Counter)
    samples: list[Sample] = field(default_factory=list)
    request_s: list[float] = field(default_factory=list)


def process_sample(pid: int, t: float) -> Sample:
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return Sample(t, rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")))


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, run: Run) -> None:
    kind = rng.choices(
        ("whole", "sse", "abandon_early", "abandon_mid", "abandon_sse", "bad_json", "bad_voice", "bad_field", "models"),
        weights=(30, 15, 10, 10, 10, 5, 5, 5, 10),
    )[0]
    body: dict = {"model": "tts-1", "voice": rng.choice(("alloy", "echo", "nova")), "input": rng.choice(TEXTS),
                  "response_format": rng.choice(FORMATS)}
    speech_url = f"{url}/v1/audio/speech"
    started = time.monotonic()
    try:
        if kind == "models":
            status = (await client.get(f"{url}/v1/models")).status_code
        elif kind == "bad_json":
            status = (await client.post(speech_url, content=b"{not json", headers={"content-type": "application/json"})).status_code
        elif kind == "bad_voice":
            status = (await client.post(speech_url, json={**body, "voice": {"id": "voice_missing"}})).status_code
        elif kind == "bad_field":
            status = (await client.post(speech_url, json={**body, "speed": 99})).status_code
        elif kind == "abandon_early":
            task = asyncio.create_task(client.post(speech_url, json=body))
            await asyncio.sleep(rng.uniform(0, 0.5))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            status = 0
        else:
            if kind in ("sse", "abandon_sse"):
                body["stream_format"] = "sse"
            async with client.stream("POST", speech_url, json=body) as response:
                status = response.status_code
                keep = rng.randint(0, 2) if kind.startswith("abandon") else -1
                async for _ in response.aiter_raw():
                    if keep == 0:
                        break
                    keep -= 1
                if status == 200 and kind in ("whole", "sse"):
                    run.request_s.append(time.monotonic() - started)  # whole-request latency
    except httpx.HTTPError as exc:
        run.outcomes[f"{kind}:{type(exc).__name__}"] += 1
        return
    run.outcomes[f"{kind}:{status}"] += 1


async def soak(url: str, pid: int, minutes: float, concurrency: int, sample_s: float, seed: int) -> Run:
    run = Run()
    rng = random.Random(seed)
    end = time.monotonic() + minutes * 60
    t0 = time.monotonic()

    async def worker() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            while time.monotonic() < end:
                await one_request(client, url, rng, run)

    async def sampler() -> None:
        while time.monotonic() < end:
            run.samples.append(process_sample(pid, time.monotonic() - t0))
            await asyncio.sleep(sample_s)

    await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    await asyncio.sleep(2)  # let the last abandoned streams be released
    run.samples.append(process_sample(pid, time.monotonic() - t0))
    return run


def summarize(run: Run, max_rss_growth_mib: float, max_fd_growth: int) -> tuple[dict, bool]:
    quarter = max(1, len(run.samples) // 4)
    head, tail = run.samples[:quarter], run.samples[-quarter:]
    summary = {
        "requests": sum(run.outcomes.values()),
        "outcomes": dict(sorted(run.outcomes.items())),
        "samples": len(run.samples),
        "rss_mib": {"first": round(run.samples[0].rss_mib, 1), "max": round(max(s.rss_mib for s in run.samples), 1),
                    "last": round(run.samples[-1].rss_mib, 1),
                    "first_quarter_mean": round(statistics.mean(s.rss_mib for s in head), 1),
                    "last_quarter_mean": round(statistics.mean(s.rss_mib for s in tail), 1)},
        "fds": {"first": run.samples[0].fds, "max": max(s.fds for s in run.samples), "last": run.samples[-1].fds},
        "whole_request_s_median": round(statistics.median(run.request_s), 3) if run.request_s else None,
    }
    rss_growth = summary["rss_mib"]["last_quarter_mean"] - summary["rss_mib"]["first_quarter_mean"]
    fd_growth = summary["fds"]["last"] - summary["fds"]["first"]
    server_errors = sum(v for k, v in run.outcomes.items() if k.split(":")[1].startswith("5"))
    summary["server_errors"] = server_errors
    ok = rss_growth <= max_rss_growth_mib and fd_growth <= max_fd_growth
    return summary, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--url", help="an already running gateway (default: start the local stack)")
    parser.add_argument("--pid", type=int, help="the gateway's process id (with --url)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0)
    parser.add_argument("--max-fd-growth", type=int, default=16)
    parser.add_argument("--out", type=Path, help="write the summary and samples as JSON here")
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        if args.url:
            if args.pid is None:
                parser.error("--url needs --pid (the gateway process to watch)")
            url, pid = args.url, args.pid
        else:
            sys.path.insert(0, str(ROOT))
            from backends.llm.vllm_launcher import free_port
            from deploy.local.stack import StackConfig, local_stack

            var = Path(os.environ.get("TTS_STACK_DIR") or tempfile.mkdtemp(prefix="tts-soak-"))
            if not os.environ.get("TTS_STACK_DIR"):
                stack.callback(shutil.rmtree, var, True)  # runs after the stack stopped
            cfg = StackConfig(var_dir=var, gateway_port=free_port(), llm_port=free_port(),
                              triton_http_port=free_port(), triton_grpc_port=free_port(),
                              triton_metrics_port=free_port())
            gateway = stack.enter_context(local_stack(cfg))
            assert gateway.proc is not None
            url, pid = gateway.url, gateway.proc.pid
        print(f"soak: {args.minutes} min against {url} (pid {pid}), concurrency {args.concurrency}", flush=True)
        run = asyncio.run(soak(url, pid, args.minutes, args.concurrency, args.sample_s, args.seed))
    summary, ok = summarize(run, args.max_rss_growth_mib, args.max_fd_growth)
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "samples": [s.__dict__ for s in run.samples]}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
