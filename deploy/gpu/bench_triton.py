"""GPU benchmark: token2wav in a real tritonserver on the GPU, driven by the gateway's own code.

    bash deploy/gpu/run.sh deploy.gpu.bench_triton --out $OUT --configs graphs,eager --concurrency 1,4,16,64

For each config (``graphs``: CUDA graphs + batching, the default; ``eager``: batching without graphs)
this starts Triton on GPU 0 with full-size random weights (fp16 by default) and runs:

- ``python -m backends.bench token2wav``: the gateway's Token2WavClient and chunk schedule straight
  against Triton, tokens arriving on the replayer timetable (20 ms prefill, then 5 ms per token);
- ``python -m backends.bench pipeline`` (``--modes``): the gateway's SpeechPipeline with the LLM token
  replayer (``backends.llm.replayer``, the named stand-in for trtllm-serve) as its LLM server;
- ``python -m backends.bench http`` (``--modes ...,http``): the whole path a client sees, the gateway
  under uvicorn (its own process, as deployed) over the same Triton and replayer, driven by the async
  OpenAI SDK, streaming pcm. ``http`` minus ``pipeline`` is the HTTP + app overhead on this machine.

Results land in OUT/<config>-<mode>/results.json + ttfa.png, and a comparison plot per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

from backends.llm.replayer import replayer_process
from backends.llm.vllm_launcher import free_port
from backends.token2wav.service import parameter_env
from deploy.gpu.triton_gpu import probe, start_gpu_triton


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.gpu.bench_triton")
    parser.add_argument("--work", type=Path, default=Path("/tmp/t2w"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--configs", default="graphs,eager",
                        help="graphs or eager, each optionally with model parameters: graphs:calm_batch_rows=16:...")
    parser.add_argument("--modes", default="token2wav,pipeline")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--tokens", default="250", help="speech tokens per request in token2wav mode")
    parser.add_argument("--max-batch", type=int, default=16, help="Triton max_batch_size (streams per engine call)")
    parser.add_argument("--graph-mib", type=int, default=16384,
                        help="GPU memory the estimator's CUDA graphs may hold (40 GiB ran out of memory at 64 streams on an H100)")
    parser.add_argument("--warmup-prompt-tokens", type=int, default=150,
                        help="token2wav captures its CUDA graphs at start for voices of this prompt length (0: off)")
    parser.add_argument("--instances", type=int, default=1,
                        help="Triton model instances on the GPU (processes: one's Python overlaps the other's GPU work)")
    parser.add_argument("--queue-delay-us", type=int, default=0,
                        help="sequence batcher max_queue_delay_microseconds (collects concurrent streams' chunks)")
    parser.add_argument("--cold-levels", dest="warm_levels", action="store_false",
                        help="no unrecorded round before each level (graph captures land in the numbers)")
    args = parser.parse_args(argv)

    from backends.llm.tiny import write_tiny_llm
    from backends.token2wav.tiny import write_token2wav_dir
    from backends.voices.presets import write_builtin_voices

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, llm_dir = args.work / "token2wav", args.work / "llm"
    if not (model_dir / "flow.pt").exists():
        write_token2wav_dir(model_dir, "full", seed=0)
    if not (llm_dir / "tokenizer.json").exists():
        write_tiny_llm(llm_dir, seed=0)  # only its tokenizer is used (prompts), the replayer generates
    voices = args.work / "voices"
    write_builtin_voices(voices, num_tokens=150)  # 6 s voice prompts, as a cloned voice would have

    env = {**os.environ, "TTS_TEXT_NORMALIZATION": "false", "TTS_LOG_FORMAT": "text"}
    with replayer_process(free_port(), "--prefill-ms", "20", "--token-ms", "5") as llm_url:
        for spec in args.configs.split(","):
            config, overrides = config_spec(spec)
            server = start_gpu_triton(args.work / config, model_dir, args.dtype, max_batch_size=args.max_batch,
                                      queue_delay_us=args.queue_delay_us, instances=args.instances,
                                      extra_env=parameter_env(cuda_graphs=int(spec.startswith("graphs")),
                                                              graph_mib=args.graph_mib,
                                                              warmup_prompt_tokens=args.warmup_prompt_tokens,
                                                              **overrides))
            try:
                # One utterance first: a server that cannot stream at all fails here, with its log.
                try:
                    rows = asyncio.run(probe(server.grpc_url, voices / "builtin" / "alloy.npz", tokens=200))
                except Exception as exc:  # noqa: BLE001 - report and skip this config
                    print(f"== {config}: probe failed: {exc!r}\n{server.log_tail(80)}", flush=True)
                    continue
                print(f"== {config}: probe ms per call " + " ".join(str(r["ms"]) for r in rows), flush=True)
                for mode in args.modes.split(","):
                    command = [sys.executable, "-m", "backends.bench", mode, "--concurrency", args.concurrency,
                               "--warmup", "3", *(["--warmup-each-level"] if args.warm_levels else []),
                               "--label", f"{config} {mode}", "--out", str(args.out / f"{config}-{mode}")]
                    gateway = None
                    if mode == "token2wav":
                        command += ["--triton", server.grpc_url, "--voices-dir", str(voices), "--tokens", args.tokens]
                    elif mode == "http":
                        gateway = start_gateway(args.out / f"{config}-gateway.log", llm_url, llm_dir, voices,
                                                server.grpc_url)
                        command += ["--url", f"{gateway.url}/v1", "--response-format", "pcm"]
                    else:
                        command += ["--triton", server.grpc_url, "--voices-dir", str(voices),
                                    "--llm-url", llm_url, "--tokenizer-dir", str(llm_dir)]
                    print(f"== {config} / {mode}", flush=True)
                    try:
                        subprocess.run(command, env=env, check=False, timeout=900)
                    finally:
                        if gateway is not None:
                            gateway.stop()
            finally:
                server.stop()
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{config}-triton.log").write_text(server.log_text()[-2_000_000:])
        for mode in args.modes.split(","):
            runs = [str(args.out / f"{config_spec(c)[0]}-{mode}" / "results.json") for c in args.configs.split(",")]
            runs = [r for r in runs if Path(r).exists()]
            if len(runs) > 1:
                subprocess.run([sys.executable, "-m", "backends.bench", "plot", *runs,
                                "--out", str(args.out / f"compare-{mode}.png")], env=env, check=False)
    return 0


def start_gateway(log_path: Path, llm_url: str, llm_dir: Path, voices: Path, triton_grpc: str):
    """The gateway under uvicorn (``deploy.local.stack.GatewayProcess``, configured as the local stack
    configures it) over this run's Triton and replayer, with the pipeline mode's settings; admission open
    to every stream the bench starts."""
    from backends.llm.vllm_launcher import free_port
    from deploy.local.stack import GatewayProcess, StackConfig, gateway_env

    cfg = StackConfig(gateway_port=free_port(), gateway_env={
        "TTS_TEXT_NORMALIZATION": "false", "TTS_LOG_FORMAT": "text", "TTS_MAX_CONCURRENT_STREAMS": "0"})
    gateway = GatewayProcess(cfg.host, cfg.gateway_port, gateway_env(cfg, llm_dir, voices, llm_url, triton_grpc),
                             log_path=log_path)
    gateway.start(ready_timeout_s=120)
    return gateway


def config_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``graphs:calm_batch_rows=16:calm_slack_ms=0`` -> (a name fit for a folder, the parameter overrides)."""
    base, *pairs = spec.split(":")
    if base not in ("graphs", "eager"):
        raise SystemExit(f"config {spec!r}: must start with graphs or eager")
    overrides = dict(pair.split("=", 1) for pair in pairs)
    name = "_".join([base, *(f"{key}-{value}" for key, value in overrides.items())])
    return name, overrides


if __name__ == "__main__":
    raise SystemExit(main())
