r"""Benchmark harness: TTFA, latency, RTF and playback underruns vs concurrency.

    python -m backends.bench http      --url http://127.0.0.1:8000/v1 --concurrency 1,2,4,8 --out DIR
    python -m backends.bench token2wav --triton 127.0.0.1:8201 --voices-dir var/voices --tokens 250 --out DIR
    python -m backends.bench pipeline  --llm-url http://127.0.0.1:8100/v1 --triton 127.0.0.1:8201 \
                                       --voices-dir var/voices --tokenizer-dir var/models/llm --out DIR
    python -m backends.bench plot      before/results.json after/results.json --out compare.png

Each run prints one table row per concurrency level as it finishes and writes DIR/results.json
(parameters, host, per-level summary and every request's record) and DIR/ttfa.png. See
docs/benchmarks.md for what each number means.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from backends.bench import report
from backends.bench.drivers import Driver, HttpDriver, PipelineDriver, Token2WavDriver, load_texts, run_level
from backends.bench.metrics import RequestRecord, summarize


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency: comma-separated positive integers, e.g. 1,2,4,8")
    return levels


def _normalize(text: str) -> bool | None:
    return {"default": None, "on": True, "off": False}[text]


def default_requests(concurrency: int) -> int:
    """Requests per level when ``--requests`` is not given: every worker runs at least two, at least 8."""
    return max(2 * concurrency, 8)


async def run(driver: Driver, args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = {"mode": driver.mode, "concurrency": args.concurrency, "requests": args.requests,
              "warmup": args.warmup, "warmup_each_level": args.warmup_each_level, "timeout_s": args.timeout_s,
              "ramp_s": args.ramp_s, "label": args.label,
              "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
              "argv": sys.argv[1:]}
    host = report.host_info()
    await driver.setup()
    params.update(driver.params())
    levels: list[dict] = []
    try:
        for i in range(args.warmup):
            record = RequestRecord(concurrency=0, index=i, worker=0, text_index=None, started_s=0.0)
            started = time.perf_counter()
            try:
                await asyncio.wait_for(driver.request(record, lambda: time.perf_counter() - started), args.timeout_s)
            except Exception as exc:  # noqa: BLE001
                print(f"[bench] warm-up request failed: {exc!r}", file=sys.stderr)
        print(report.table([], title=f"{driver.mode}: {args.label or out}"), flush=True)
        for concurrency in args.concurrency:
            n = args.requests or default_requests(concurrency)
            if args.warmup_each_level:
                # One unrecorded round at this concurrency first: on a GPU with CUDA graphs, batch
                # shapes seen for the first time are captured (hundreds of ms each); without this
                # round those one-off captures land in the level's percentiles.
                warm, _ = await run_level(driver, concurrency, concurrency, timeout_s=args.timeout_s, ramp_s=args.ramp_s)
                failed = sum(1 for r in warm if r.error)
                if failed:
                    print(f"[bench] {failed} of {len(warm)} warm-up requests at concurrency {concurrency} failed",
                          file=sys.stderr)
            cpu_before = time.process_time()
            records, wall = await run_level(driver, concurrency, n, timeout_s=args.timeout_s, ramp_s=args.ramp_s)
            summary = summarize(concurrency, records, wall)
            # This process's CPU (all its threads) over the level: near 100 % of a core, the client
            # side (in ``pipeline`` mode the gateway's own code) is what lags, not the servers.
            summary["bench_cpu_pct"] = round(100 * (time.process_time() - cpu_before) / wall, 1) if wall > 0 else None
            levels.append({"summary": summary, "requests": [r.as_dict() for r in records]})
            print(report.table([summary]).splitlines()[-1], flush=True)
            for error, count in summary["errors_by_type"].items():
                example = next(r.error_message for r in records if r.error == error)
                print(f"      {count} x {error}: {example}", flush=True)
            report.write_results(out, driver.mode, params, levels, host)  # partial results survive a crash
    finally:
        await driver.close()
    host["loadavg_end"] = report.host_info()["loadavg"]
    results_path = report.write_results(out, driver.mode, params, levels, host)
    results = report.load_results(results_path)
    png = report.try_plot([(args.label or driver.mode, results)], out / "ttfa.png",
                          title=f"TTFA vs concurrency ({driver.mode})")
    print(f"results: {results_path}" + (f", plot: {png}" if png else ""), flush=True)
    return results


def _loop_factory(name: str):
    """uvloop where installed (what uvicorn, so the gateway, runs on), so ``pipeline`` and ``http``
    compare like with like; ``asyncio`` for the standard loop."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=_levels, default=_levels("1,2,4,8,16,32,64"),
                        help="comma-separated levels (default 1,2,4,8,16,32,64)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per level (default: max(2 x concurrency, 8))")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded requests before the first level")
    parser.add_argument("--warmup-each-level", action="store_true",
                        help="one unrecorded round of `concurrency` requests before each level (steady state, "
                             "e.g. after CUDA-graph capture of that level's batch shapes)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument("--ramp-s", type=float, default=0.0,
                        help="spread the workers' first requests over this many seconds (default: all at once)")
    parser.add_argument("--label", default=None, help="name of this run in tables and plots")
    parser.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                        help="event loop of the benchmark process (auto: uvloop if installed)")
    parser.add_argument("--out", required=True, help="folder for results.json and ttfa.png")


def _texts_and_voice(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--texts", default="default", help="'default' (8 built-in sentences) or a file, one per line")
    parser.add_argument("--voice", default="alloy")
    parser.add_argument("--normalize", choices=["default", "on", "off"], default="default",
                        help="text normalization per request (default: the server's setting)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backends.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    http = sub.add_parser("http", help="the gateway over HTTP (OpenAI SDK, streaming)")
    http.add_argument("--url", default="http://127.0.0.1:8000/v1")
    http.add_argument("--model", default="tts-1")
    http.add_argument("--response-format", default="pcm", choices=["pcm", "wav", "mp3", "opus", "aac", "flac"])
    http.add_argument("--api-key", default="bench")
    _texts_and_voice(http)
    _common(http)

    t2w = sub.add_parser("token2wav", help="Triton directly, tokens on the replayer's timetable")
    t2w.add_argument("--triton", default="127.0.0.1:8201", help="gRPC HOST:PORT")
    t2w.add_argument("--model", default="token2wav_dit")
    t2w.add_argument("--voice", default="alloy", help="an .npz path, a built-in name (with --voices-dir), or 'random'")
    t2w.add_argument("--voices-dir", default="var/voices")
    t2w.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 per second)")
    t2w.add_argument("--prefill-ms", type=float, default=20.0)
    t2w.add_argument("--token-ms", type=float, default=5.0)
    t2w.add_argument("--schedule", default="exponential100", help="chunk schedule (gateway/pipeline.py)")
    t2w.add_argument("--seed", type=int, default=0)
    _common(t2w)

    pipe = sub.add_parser("pipeline", help="gateway.pipeline.SpeechPipeline in-process (no HTTP)")
    pipe.add_argument("--llm-url", default="http://127.0.0.1:8100/v1")
    pipe.add_argument("--llm-model", default="cosyvoice2")
    pipe.add_argument("--triton", default="127.0.0.1:8201", help="gRPC HOST:PORT")
    pipe.add_argument("--voices-dir", default="var/voices")
    pipe.add_argument("--tokenizer-dir", default="var/models/llm", help="the LLM folder's tokenizer.json")
    pipe.add_argument("--schedule", default=None, help="chunk schedule (default: TTS_CHUNK_SCHEDULE or exponential100)")
    _texts_and_voice(pipe)
    _common(pipe)

    plot = sub.add_parser("plot", help="overlay several results.json in one PNG (before/after)")
    plot.add_argument("results", nargs="+")
    plot.add_argument("--labels", default=None, help="comma-separated, one per file (default: the folder names)")
    plot.add_argument("--metric", default="ttfa", choices=["ttfa", "total", "first_chunk", "llm_first_token"])
    plot.add_argument("--out", required=True, help="the PNG to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plot":
        labels = args.labels.split(",") if args.labels else [Path(p).resolve().parent.name for p in args.results]
        if len(labels) != len(args.results):
            raise SystemExit("--labels: one per results file")
        runs = [(label, report.load_results(path)) for label, path in zip(labels, args.results)]
        print(report.compare_table(runs, args.metric))
        path = report.plot_runs(runs, Path(args.out), args.metric)
        print(f"plot: {path}")
        return 0
    driver: Driver
    if args.command == "http":
        driver = HttpDriver(args.url, load_texts(args.texts), model=args.model, voice=args.voice,
                            response_format=args.response_format, api_key=args.api_key,
                            normalize=_normalize(args.normalize), timeout_s=args.timeout_s)
    elif args.command == "token2wav":
        driver = Token2WavDriver(args.triton, model=args.model, voice=args.voice, voices_dir=args.voices_dir,
                                 tokens=args.tokens, prefill_ms=args.prefill_ms, token_ms=args.token_ms,
                                 schedule=args.schedule, seed=args.seed, timeout_s=args.timeout_s)
    else:
        settings = {"llm_url": args.llm_url, "llm_model": args.llm_model, "triton_url": args.triton,
                    "voices_dir": args.voices_dir, "llm_tokenizer_dir": args.tokenizer_dir,
                    "llm_timeout_s": args.timeout_s, "triton_timeout_s": args.timeout_s}
        if args.schedule:
            settings["chunk_schedule"] = args.schedule
        driver = PipelineDriver(load_texts(args.texts), settings, voice=args.voice, normalize=_normalize(args.normalize))
    factory = _loop_factory(args.loop)
    if factory is None or not hasattr(asyncio, "Runner"):  # asyncio.Runner: python >= 3.11
        results = asyncio.run(run(driver, args))
    else:
        with asyncio.Runner(loop_factory=factory) as runner:
            results = runner.run(run(driver, args))
    errors = sum(level["summary"]["errors"] for level in results["levels"])
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
