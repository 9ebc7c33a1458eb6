"""The gateway's HTTP + encoding overhead on this machine (not in CI; docs/benchmarks.md, issue 9).

    .venv/bin/python deploy/local/http_overhead.py --out runs/overhead [--concurrency 1,4] [--formats pcm,mp3]

Starts the LLM token replayer (the named stand-in for an LLM server: speech tokens on a fixed
timetable, so the LLM costs the same every run) and the local stack's Triton + gateway on it, then
runs ``python -m backends.bench`` twice at the same settings:

- ``http``: the async OpenAI SDK against the gateway (streaming, each ``--formats`` in turn);
- ``pipeline``: the gateway's ``SpeechPipeline`` in-process against the same Triton and replayer.

TTFA and total latency of ``http`` minus ``pipeline`` is what HTTP, the app and encoding add.
Writes OUT/<mode>[-<format>]/results.json and prints the bench tables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--formats", default="pcm,mp3")
    parser.add_argument("--requests", type=int, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from backends.llm.replayer import replayer_process
    from backends.llm.vllm_launcher import free_port
    from deploy.local.stack import StackConfig, local_stack

    var = Path(tempfile.mkdtemp(prefix="tts-overhead-"))
    env = {**os.environ, "TTS_TEXT_NORMALIZATION": "false"}
    common = ["--concurrency", args.concurrency, "--warmup", "2", "--normalize", "off"]
    if args.requests:
        common += ["--requests", str(args.requests)]
    try:
        with replayer_process(free_port(), "--prefill-ms", "20", "--token-ms", "5") as replayer_url:
            cfg = StackConfig(var_dir=var, gateway_port=free_port(), llm_port=free_port(),
                              triton_http_port=free_port(), triton_grpc_port=free_port(),
                              triton_metrics_port=free_port(), external_llm_url=replayer_url,
                              gateway_env={"TTS_TEXT_NORMALIZATION": "false"})
            with local_stack(cfg) as gateway:
                triton = f"127.0.0.1:{cfg.triton_grpc_port}"
                runs = [("pipeline", ["pipeline", "--llm-url", replayer_url, "--triton", triton, "--voices-dir",
                                      str(var / "voices"), "--tokenizer-dir", str(var / "models" / "llm")])]
                runs += [(f"http-{fmt}", ["http", "--url", f"{gateway.url}/v1", "--response-format", fmt])
                         for fmt in args.formats.split(",")]
                for name, command in runs:
                    print(f"== {name}", flush=True)
                    subprocess.run([sys.executable, "-m", "backends.bench", *command, *common, "--label", name,
                                    "--out", str(args.out / name)], env=env, cwd=ROOT, check=False, timeout=1800)
    finally:
        shutil.rmtree(var, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
