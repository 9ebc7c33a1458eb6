"""Where one streaming chunk's time goes on a GPU: encoder, estimator (10 Euler steps), cache
truncation, HiFT; eager vs the engine's fast paths; batched chunks of several streams.

    python -m deploy.gpu.profile_flow --dtype float16 [--batch 1,4,16]

Full-size random weights, a 150-token voice prompt, the upstream schedule. Prints JSON lines and a
torch.profiler table of the steady chunk (top ops by CPU time), which says whether the chunk is
bound by kernel launches (CPU time ≫ CUDA time) or by the GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time

import numpy as np
import torch

from backends.token2wav import fused
from backends.token2wav.engine import Token2WavEngine, load_flow_checkpoint
from backends.token2wav.tiny import write_token2wav_dir


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, (time.perf_counter() - start) * 1e3


def split_chunk(engine: Token2WavEngine, state, tokens: list[int], last_chunk: bool) -> dict:
    """Time the parts of engine._flow_chunk + _vocode separately for one chunk."""
    flow, device = engine.flow, engine.device
    token_tensor = torch.tensor([tokens], dtype=torch.long, device=device)
    cache = state.flow_cache

    def encode():
        h, cnn, att = flow.encoder.forward_chunk(flow.input_embedding(token_tensor), last_chunk,
                                                 cache.conformer_cnn, cache.conformer_att)
        return flow.encoder_proj(h), cnn, att

    (h, _, _), enc_ms = _timed(encode, device)
    mu = h.transpose(1, 2).contiguous()
    noise = state.flow_noise.take(h.shape[1]).to(device, engine.dtype)

    def estimate():
        return flow.decoder.forward_chunk(mu, state.voice.projected_speaker, torch.zeros_like(mu), noise,
                                          engine.n_timesteps, cache.estimator_cnn, cache.estimator_att.kept())

    (mel, _, _), est_ms = _timed(estimate, device)
    return {"tokens": len(tokens), "frames": int(mel.shape[2]), "cache_frames": int(cache.estimator_att.kept().shape[4]),
            "encoder_ms": round(enc_ms, 2), "estimator_ms": round(est_ms, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.gpu.profile_flow")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="full")
    parser.add_argument("--batches", default="", help="e.g. 1,4,8,16: batched feed_many rounds with CUDA graphs")
    parser.add_argument("--compile", type=int, default=1, help="1: the engine's compile_fused (fused DiT kernels)")
    parser.add_argument("--kernel-batch", type=int, default=0,
                        help="also profile one eager 100-token feed_many round of this many streams: GPU time per kernel")
    parser.add_argument("--timeline", default="",
                        help="e.g. 1,16: after the engine's warm-up (CUDA graphs), profile a first-chunk and a 100-token "
                             "feed_many round of each many streams: wall vs GPU-busy time, host syncs, top kernels")
    parser.add_argument("--trace-dir", default="", help="with --timeline: write each round's Chrome trace here")
    parser.add_argument("--host-profile", type=int, default=0,
                        help="with --timeline: cProfile this many one-stream first-chunk and 100-token calls on the "
                             "warm engine and print the Python functions that took the host's time")
    parser.add_argument("--graph-mib", type=int, default=24576)
    args = parser.parse_args(argv)
    device = args.device
    rng = np.random.default_rng(0)
    prompt = (rng.integers(0, 6561, args.prompt_tokens),
              (rng.standard_normal((2 * args.prompt_tokens, 80)) - 5).astype(np.float32),
              rng.standard_normal(192).astype(np.float32))
    tokens = [int(t) for t in rng.integers(0, 6561, 600)]
    tmp = tempfile.mkdtemp(prefix="t2w-profile-")
    write_token2wav_dir(tmp, args.size, seed=0)
    engine = Token2WavEngine.load(tmp, device=device, dtype=args.dtype, compile_fused=bool(args.compile))
    voice = engine.prepare_voice(*prompt)
    print(json.dumps({"gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__, "dtype": args.dtype}))

    print(json.dumps({"part": "fused_vs_plain", **fused_vs_plain(engine, voice, tmp)}))

    # Warm-up stream, then a measured one: split timings per chunk.
    for run in range(2):
        state = engine.start_stream(voice, seed=run)
        at = 0
        for size in (18, 25, 50, 100, 100, 100):
            piece = tokens[at:at + size]
            at += size
            state.pending.extend(piece)
            ready = len(state.pending) - engine.lookahead
            if run == 1:
                print(json.dumps({"part": "split", **split_chunk(engine, state, state.pending, False)}))
            _, feed_ms = _timed(lambda: engine._flow_chunk(state, state.pending, last_chunk=False), engine.device)
            state.pending = state.pending[ready:]
            if run == 1:
                print(json.dumps({"part": "flow_chunk_total", "tokens": size, "ms": round(feed_ms, 2)}))

    # Profile one steady 100-token chunk.
    state = engine.start_stream(voice, seed=5)
    for size in (18, 25, 50):
        engine.feed(state, tokens[:size], final=False)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])) as prof:
        engine.feed(state, tokens[100:200], final=False)
        _sync(device)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    print(table)
    events = prof.key_averages()
    cpu_total = sum(e.self_cpu_time_total for e in events) / 1e3
    cuda_total = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(json.dumps({"part": "profile_steady_chunk", "self_cpu_ms": round(cpu_total, 1),
                      "self_cuda_ms": round(cuda_total, 1), "kernel_launches": launches}))
    if args.kernel_batch:
        kernel_table(engine, voice, tokens, args.kernel_batch)
    if args.timeline:
        del engine
        graphed = Token2WavEngine.load(tmp, device=device, dtype=args.dtype, cuda_graphs=True,
                                       graph_mib=args.graph_mib, compile_fused=bool(args.compile))
        graphed_voice = graphed.prepare_voice(*prompt)
        graphed.warm_up(graphed_voice, max_rows=max(int(b) for b in args.timeline.split(",")))
        print(json.dumps({"part": "warm_up", "graphs": graphed.graph_summary()}))
        for batch in (int(b) for b in args.timeline.split(",")):
            timeline(graphed, graphed_voice, tokens, batch, args.trace_dir)
        if args.host_profile:
            host_profile(graphed, graphed_voice, tokens, args.host_profile)
    if args.batches:
        graphed = Token2WavEngine.load(tmp, device=device, dtype=args.dtype, cuda_graphs=True,
                                       compile_fused=bool(args.compile))
        graphed_voice = graphed.prepare_voice(*prompt)
        for batch in (int(b) for b in args.batches.split(",")):
            for mode in ("graphs", "eager") if batch <= 8 else ("graphs",):
                print(json.dumps({"part": "batched_rounds", "mode": mode, "batch": batch,
                                  **batched_rounds(graphed, graphed_voice, tokens, batch, eager=mode == "eager")}))
        for batch in (int(b) for b in args.batches.split(",")):
            print(json.dumps({"part": "staggered_rounds", "batch": batch,
                              **staggered_rounds(graphed, graphed_voice, tokens, batch)}))
        if graphed.graphed_solve is not None:
            print(json.dumps({"part": "graphs", "count": graphed.graphed_solve.num_graphs,
                              "graph_mib": round(graphed.graphed_solve.graph_bytes / 2**20),
                              "replays": graphed.graphed_solve.replays, "eager_runs": graphed.graphed_solve.eager_runs,
                              "encoder_graphs": graphed.encode.num_graphs,
                              "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20)}))
    return 0


def fused_vs_plain(engine: Token2WavEngine, voice, model_dir: str) -> dict:
    """One 100-frame chunk over the voice's prompt cache, solved by the engine's flow (what ``freeze``
    precomputed; compiled fused kernels if on) and by the same checkpoint loaded plain, run eagerly: the
    largest difference, against the output's scale. The first call also times the compilation."""
    device, dtype = engine.device, engine.dtype
    generator = torch.Generator(device="cpu").manual_seed(0)
    mu, z = (torch.randn(1, 80, 100, generator=generator).to(device, dtype) for _ in range(2))
    cache = voice.prompt_cache

    def solve(decoder):
        return decoder.forward_chunk(mu, voice.projected_speaker, torch.zeros_like(mu), z, engine.n_timesteps,
                                     cache.estimator_cnn, cache.estimator_att.kept())[0].float()

    start = time.perf_counter()
    fused_out = solve(engine.flow.decoder)
    first_ms = (time.perf_counter() - start) * 1e3
    plain_flow = load_flow_checkpoint(model_dir).to(device=device, dtype=dtype).eval()
    compiled = fused.is_compiled()
    fused.use_compiled(False)
    try:
        plain = solve(plain_flow.decoder)
    finally:
        fused.use_compiled(compiled)
    del plain_flow
    return {"compiled": compiled, "first_call_ms": round(first_ms), "max_abs_diff": round(float((fused_out - plain).abs().max()), 5),
            "max_abs": round(float(plain.abs().max()), 3), "finite": bool(torch.isfinite(fused_out).all())}


def kernel_table(engine: Token2WavEngine, voice, tokens: list[int], batch: int) -> None:
    """GPU time per kernel of one eager 100-token ``feed_many`` round of ``batch`` streams (after 18,
    25 and 50 tokens): which kernels a graph replay of that round spends its time in."""
    from torch.profiler import ProfilerActivity, profile

    states = [engine.start_stream(voice, seed=k) for k in range(batch)]
    at = 0
    for size in (18, 25, 50):
        engine.feed_many([(st, tokens[at:at + size], False) for st in states])
        at += size
    piece = tokens[at:at + 100]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        engine.feed_many([(st, piece, False) for st in states])
        _sync(engine.device)
    # Operators by GPU time, their kernels included, and by input shape: which calls the copy kernels serve.
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    for e in sorted(ops, key=lambda e: -e.device_time_total)[:16]:
        print(json.dumps({"op": e.key, "shapes": str(e.input_shapes)[:150], "count": e.count,
                          "ms": round(e.device_time_total / 1e3, 2)}))
    # ("## Call CompiledFxGraph" rows span a compiled function's kernels, which are listed themselves.)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.key.startswith("## Call CompiledFxGraph")]
    total = sum(e.self_device_time_total for e in kernels) / 1e3 or float("nan")   # nan on a CPU run
    print(json.dumps({"part": "kernel_table", "batch": batch, "gpu_ms": round(total, 1),
                      "kernels": sum(e.count for e in kernels)}))
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:30]:
        print(json.dumps({"kernel": e.key[:110], "count": e.count, "ms": round(e.self_device_time_total / 1e3, 2),
                          "share": round(e.self_device_time_total / 1e3 / total, 3)}))


def timeline(engine: Token2WavEngine, voice, tokens: list[int], batch: int, trace_dir: str) -> None:
    """Profile the first-chunk and a 100-token ``feed_many`` round of ``batch`` streams on a warm
    engine: wall time against the time the GPU was busy (the union of kernel, copy and memset
    intervals), host syncs and host-to-device copies, and the biggest kernels. Idle GPU time inside a
    call is host work the GPU waited for (after a sync)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    for attempt in range(2):
        states = [engine.start_stream(voice, seed=100 * attempt + k) for k in range(batch)]
        at = 0
        for label, size in (("first", 18), ("25", 25), ("50", 50), ("100", 100)):
            piece = tokens[at:at + size]
            at += size
            run = lambda: engine.feed_many([(st, piece, False) for st in states])  # noqa: E731
            if attempt == 0 or label not in ("first", "100"):
                run()
                continue
            _sync(engine.device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start = time.perf_counter()
                run()
                _sync(engine.device)
                wall_ms = (time.perf_counter() - start) * 1e3
            directory = trace_dir or tempfile.mkdtemp()
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"timeline-{batch}-{label}.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
            on_gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
            gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in on_gpu)
            busy, end = 0.0, -1.0
            for s0, s1 in gpu:
                if s1 > end:
                    busy += s1 - max(s0, end)
                    end = s1
            host = {}
            for e in events:
                if e.get("cat") == "cuda_runtime" and e.get("name") in (
                        "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaGraphLaunch",
                        "cudaEventSynchronize", "cudaMemsetAsync"):
                    count, ms = host.get(e["name"], (0, 0.0))
                    host[e["name"]] = (count + 1, round(ms + e.get("dur", 0) / 1e3, 2))
            by_kernel: dict[str, list] = {}
            for e in on_gpu:
                entry = by_kernel.setdefault(e["name"][:90], [0, 0.0])
                entry[0] += 1
                entry[1] += e["dur"] / 1e3
            top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:14]
            print(json.dumps({"part": "timeline", "batch": batch, "round": label, "wall_ms": round(wall_ms, 2),
                              "gpu_busy_ms": round(busy / 1e3, 2),
                              "gpu_span_ms": round((gpu[-1][1] - gpu[0][0]) / 1e3, 2) if gpu else 0,
                              "gpu_ops": len(on_gpu), "host_calls": host}))
            for name, (count, ms) in top:
                print(json.dumps({"kernel": name, "count": count, "ms": round(ms, 2)}))
            # By count too: with one stream a call is bound by how many kernels it runs, not by the largest.
            for name, (count, ms) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:20]:
                print(json.dumps({"kernel_by_count": name, "count": count, "ms": round(ms, 2)}))


def host_profile(engine: Token2WavEngine, voice, tokens: list[int], rounds: int) -> None:
    """Where a one-stream call's host time goes: cProfile over ``rounds`` first-chunk and 100-token
    ``feed_many`` calls of a warm engine (the GPU runs CUDA graphs, so what is left is Python and the
    waits for the GPU), the top functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    walls: dict[str, list[float]] = {"first": [], "100": []}
    for attempt in range(rounds):
        state = engine.start_stream(voice, seed=7000 + attempt)
        at = 0
        for label, size in (("first", 18), ("25", 25), ("50", 50), ("100", 100)):
            piece = tokens[at:at + size]
            at += size
            _sync(engine.device)
            start = time.perf_counter()
            if label in walls:
                profiler.enable()
                engine.feed_many([(state, piece, False)])
                profiler.disable()
                walls[label].append((time.perf_counter() - start) * 1e3)
            else:
                engine.feed_many([(state, piece, False)])
    print(json.dumps({"part": "host_profile", "rounds": rounds,
                      "wall_ms_median": {k: round(sorted(v)[len(v) // 2], 2) for k, v in walls.items()}}))
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(30)
        print(f"## host profile by {order}\n" + out.getvalue())


def batched_rounds(engine: Token2WavEngine, voice, tokens: list[int], batch: int, eager: bool) -> dict:
    """``batch`` streams of one voice fed together through the schedule 18, 25, 50, 100, 100 tokens
    (``feed_many``: one batched flow call per round). Three passes; the third is timed (the first two
    run eagerly and capture graphs). Returns the wall time of each round in ms."""
    saved = engine.solve, engine.encode, engine.hift._graphed_decode
    if eager:
        engine.solve = functools.partial(engine.flow.decoder.forward_chunk, new_only=True)
        engine.encode, engine.hift._graphed_decode = engine._encode, None
    try:
        rounds: list[float] = []
        for attempt in range(3):
            states = [engine.start_stream(voice, seed=attempt * 1000 + k) for k in range(batch)]
            rounds, at = [], 0
            for size in (18, 25, 50, 100, 100):
                piece = tokens[at:at + size]
                at += size
                (results, ms) = _timed(lambda: engine.feed_many([(st, piece, False) for st in states]), engine.device)
                assert all(isinstance(r, np.ndarray) for r in results), results
                rounds.append(round(ms, 2))
        return {"round_ms": rounds, "first_chunk_ms": rounds[0], "steady_100_token_ms": rounds[-1]}
    finally:
        engine.solve, engine.encode, engine.hift._graphed_decode = saved


def staggered_rounds(engine: Token2WavEngine, voice, tokens: list[int], batch: int) -> dict:
    """``batch`` streams at different points of the schedule in every ``feed_many`` call: stream k
    joins at round k mod 4 and runs 18, 25, 50, 100, 100, 100 tokens (the last with final=True), then
    a new stream takes its place. This is what a server sees under steady load. Two passes (capture),
    then one timed; returns the wall time per round (ms) once every slot is busy, and the solve's
    graph replays vs eager runs during the timed pass."""
    schedule = (18, 25, 50, 100, 100, 100)
    solve = engine.graphed_solve
    for attempt in range(3):
        slots: list[list] = [[None, -(k % 4), 0] for k in range(batch)]   # state, call index, token offset
        replays, eager = (solve.replays, solve.eager_runs) if solve is not None else (0, 0)
        rounds: list[float] = []
        for round_index in range(16):
            items = []
            for k, slot in enumerate(slots):
                if slot[1] < 0:
                    slot[1] += 1
                    continue
                if slot[0] is None:
                    slot[0], slot[2] = engine.start_stream(voice, seed=attempt * 10_000 + round_index * 100 + k), 0
                size = schedule[slot[1]]
                items.append((slot[0], tokens[slot[2]:slot[2] + size], slot[1] == len(schedule) - 1))
                slot[2] += size
                slot[1] += 1
                if slot[1] == len(schedule):
                    slot[0], slot[1] = None, 0
            (results, ms) = _timed(lambda: engine.feed_many(items), engine.device)
            assert all(isinstance(r, np.ndarray) for r in results), results
            if round_index >= 4:
                rounds.append(round(ms, 2))
    out = {"round_ms": rounds, "p50_ms": round(float(np.median(rounds)), 2), "max_ms": max(rounds)}
    if solve is not None:
        out.update(solve_replays=solve.replays - replays, solve_eager=solve.eager_runs - eager)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
