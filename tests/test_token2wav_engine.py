"""Token2WavEngine at the tiny config on CPU: lengths, flush, independence, validation, long streams."""
from __future__ import annotations

import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.token2wav.__main__ import stream_schedule
from backends.token2wav.engine import FrameNoise, Token2WavEngine
from backends.token2wav.scheduling import CallCosts
from backends.token2wav.tiny import write_token2wav_dir

SAMPLES_PER_TOKEN = 960
HELD_BACK = 3840


@pytest.fixture(scope="module")
def single_thread():
    # 2 shared cores: intra-op threads fighting other processes make tiny models 10x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_token2wav_dir(tmp_path_factory.mktemp("t2w") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir, single_thread) -> Token2WavEngine:
    return Token2WavEngine.load(model_dir)


def _voice_inputs(seed: int, n_tokens: int = 30):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 6561, n_tokens),
            (rng.standard_normal((2 * n_tokens, 80)) - 5).astype(np.float32),
            rng.standard_normal(192).astype(np.float32))


@pytest.fixture(scope="module")
def voice(engine):
    return engine.prepare_voice(*_voice_inputs(0))


@pytest.fixture(scope="module")
def other_voice(engine):
    return engine.prepare_voice(*_voice_inputs(1, n_tokens=24), lookahead_pad="repeat")


def _tokens(n: int, seed: int = 7) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 6561, n)]


def _run_stream(engine, voice, tokens, sizes, seed=0) -> list[np.ndarray]:
    state = engine.start_stream(voice, seed=seed)
    outs, at = [], 0
    for i, size in enumerate(sizes):
        outs.append(engine.feed(state, tokens[at:at + size], final=i == len(sizes) - 1))
        at += size
    assert at == len(tokens)
    return outs


def test_first_chunk_waits_for_15_plus_3_tokens(engine, voice):
    state = engine.start_stream(voice)
    tokens = _tokens(40)
    assert engine.feed(state, tokens[:17], final=False).size == 0
    first = engine.feed(state, tokens[17:18], final=False)
    # 15 tokens = 30 mel frames, minus the 8 frames held back for the cross-fade: 0.44 s
    assert first.dtype == np.float32 and first.shape == (15 * SAMPLES_PER_TOKEN - HELD_BACK,)
    assert np.abs(first).max() > 0
    # after the first chunk, any new token beyond the lookahead is synthesised
    assert engine.feed(state, tokens[18:19], final=False).shape == (SAMPLES_PER_TOKEN,)
    rest = engine.feed(state, tokens[19:], final=True)
    total = first.size + SAMPLES_PER_TOKEN + rest.size
    assert total == 40 * SAMPLES_PER_TOKEN


@pytest.mark.parametrize("sizes", [[18, 25, 50, 7], [5, 5, 5, 5, 80], [100], [3], [20, 1, 1, 1, 0, 77]])
def test_stream_length_is_exactly_960_per_token(engine, voice, sizes):
    tokens = _tokens(sum(sizes))
    outs = _run_stream(engine, voice, tokens, sizes)
    assert sum(o.size for o in outs) == len(tokens) * SAMPLES_PER_TOKEN
    assert all(np.isfinite(o).all() for o in outs)


def test_final_flush_with_no_new_tokens_returns_the_held_back_tail(engine, voice):
    state = engine.start_stream(voice)
    tokens = _tokens(45)
    first = engine.feed(state, tokens, final=False)   # the first chunk is 15 tokens; 27 wait, +3 lookahead
    assert first.size == 15 * SAMPLES_PER_TOKEN - HELD_BACK
    second = engine.feed(state, [], final=False)      # 25 of them (whole chunks), 2 + 3 wait
    assert second.size == 25 * SAMPLES_PER_TOKEN
    tail = engine.feed(state, [], final=True)   # 2 + 3 lookahead tokens + the held-back samples
    assert tail.size == 5 * SAMPLES_PER_TOKEN + HELD_BACK
    assert state.flow_cache is None and state.pending == []   # state released on final
    with pytest.raises(RuntimeError, match="already finished"):
        engine.feed(state, [1], final=False)


def test_empty_stream_flushes_to_nothing(engine, voice):
    state = engine.start_stream(voice)
    assert engine.feed(state, [], final=True).size == 0


def test_interleaved_streams_equal_their_solo_runs(engine, voice, other_voice):
    tokens_a, tokens_b = _tokens(90, seed=1), _tokens(70, seed=2)
    sizes_a, sizes_b = [18, 25, 47], [20, 30, 20]
    solo_a = _run_stream(engine, voice, tokens_a, sizes_a, seed=11)
    solo_b = _run_stream(engine, other_voice, tokens_b, sizes_b, seed=22)

    state_a = engine.start_stream(voice, seed=11)
    state_b = engine.start_stream(other_voice, seed=22)
    mixed_a, mixed_b, at_a, at_b = [], [], 0, 0
    for i in range(3):
        mixed_b.append(engine.feed(state_b, tokens_b[at_b:at_b + sizes_b[i]], final=i == 2))
        mixed_a.append(engine.feed(state_a, tokens_a[at_a:at_a + sizes_a[i]], final=i == 2))
        at_a += sizes_a[i]
        at_b += sizes_b[i]
    for solo, mixed in ((solo_a, mixed_a), (solo_b, mixed_b)):
        np.testing.assert_array_equal(np.concatenate(solo), np.concatenate(mixed))
    # and the two streams really differ (different voice and seed)
    assert not np.allclose(np.concatenate(solo_a)[:20000], np.concatenate(solo_b)[:20000])


def test_seed_changes_output_and_same_seed_reproduces(engine, voice):
    tokens = _tokens(30)
    a = np.concatenate(_run_stream(engine, voice, tokens, [30], seed=1))
    b = np.concatenate(_run_stream(engine, voice, tokens, [30], seed=1))
    c = np.concatenate(_run_stream(engine, voice, tokens, [30], seed=2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_voice_is_not_modified_by_streams(engine, voice):
    before = [t.clone() for t in voice.prompt_cache.tensors()]
    entries = voice.prompt_cache.estimator_att.entries
    state = engine.start_stream(voice)
    assert state.flow_cache.estimator_att.kv is not voice.prompt_cache.estimator_att.kv   # written in place: its own
    engine.feed(state, _tokens(60)[:18], final=False)
    engine.feed(state, _tokens(60)[18:], final=True)
    assert all(torch.equal(a, b) for a, b in zip(before, voice.prompt_cache.tensors()))
    assert voice.prompt_cache.estimator_att.entries == entries


@pytest.mark.parametrize("bad", [[1, 6561], [-1], [2.5, 3.0], [[1, 2], [3, 4]]])
def test_invalid_token_ids_are_rejected(engine, voice, bad):
    state = engine.start_stream(voice)
    with pytest.raises(ValueError):
        engine.feed(state, bad, final=False)
    with pytest.raises(ValueError):
        engine.synthesize(voice, bad)


def test_invalid_id_message_names_the_position_and_range(engine, voice):
    with pytest.raises(ValueError, match=r"tokens\[2\] = 7000 is outside the speech token range 0\.\.6560"):
        engine.feed(engine.start_stream(voice), np.array([1, 2, 7000]), final=False)


def test_prepare_voice_validates_inputs(engine):
    tokens, mel, spk = _voice_inputs(3)
    with pytest.raises(ValueError, match="prompt_tokens"):
        engine.prepare_voice(np.append(tokens, 6561), mel, spk)
    with pytest.raises(ValueError, match="frames"):
        engine.prepare_voice(tokens, mel[:40], spk)
    with pytest.raises(ValueError, match="speaker_embedding"):
        engine.prepare_voice(tokens, mel, spk[:100])
    with pytest.raises(ValueError, match="lookahead_pad"):
        engine.prepare_voice(tokens, mel, spk, lookahead_pad="zeros")
    with pytest.raises(ValueError, match="empty"):
        engine.prepare_voice([], mel[:0], spk)
    # torch inputs and a 2-frame-short mel (padded as upstream) are accepted
    voice = engine.prepare_voice(torch.from_numpy(tokens), torch.from_numpy(mel[:-2]), torch.from_numpy(spk))
    assert voice.prompt_frames == 2 * len(tokens)


def test_pad_choice_matters_for_streaming(engine):
    inputs = _voice_inputs(4)
    silence = engine.prepare_voice(*inputs, lookahead_pad="silence")
    repeat = engine.prepare_voice(*inputs, lookahead_pad="repeat")
    assert silence.lookahead_pad == "silence" and repeat.lookahead_pad == "repeat"
    tokens = _tokens(30)
    a = np.concatenate(_run_stream(engine, silence, tokens, [30]))
    b = np.concatenate(_run_stream(engine, repeat, tokens, [30]))
    assert not np.array_equal(a, b)


def test_offline_synthesis_length_and_closeness_to_streaming(engine, voice):
    tokens = _tokens(300)
    offline = engine.synthesize(voice, tokens, seed=5)
    assert offline.shape == (300 * SAMPLES_PER_TOKEN,)

    # Compare mels (HiFT's NSF noise differs between one call and many, by design): streaming is
    # chunk-causal, offline sees everything, so they differ most in the first chunk. Measured at this
    # config: 1.8 % relative RMS overall, 6.4 % on the first chunk, <1 % from the 4th chunk on.
    mels = []
    original = engine._vocode_many

    def record(states, chunk_mels, final):
        mels.append(chunk_mels[0].clone())
        return original(states, chunk_mels, final)

    engine._vocode_many = record
    try:
        streamed = np.concatenate(_run_stream(engine, voice, tokens, stream_schedule(300), seed=5))
    finally:
        engine._vocode_many = original
    assert streamed.shape == offline.shape
    stream_mel = torch.cat(mels, dim=2)
    noise = torch.cat([voice.prompt_noise, FrameNoise(5).take(600)], dim=2)
    offline_mel = engine.flow.inference(torch.tensor([tokens]), voice.prompt_tokens, voice.prompt_mel,
                                        voice.speaker_embedding, engine._fixed_noise(noise), engine.n_timesteps)
    relative = ((stream_mel - offline_mel).pow(2).mean().sqrt() / offline_mel.std()).item()
    assert relative < 0.05
    # with different noise the mels are far apart: the comparison above is meaningful
    other = torch.cat([voice.prompt_noise, FrameNoise(6).take(600)], dim=2)
    other_mel = engine.flow.inference(torch.tensor([tokens]), voice.prompt_tokens, voice.prompt_mel,
                                      voice.speaker_embedding, engine._fixed_noise(other), engine.n_timesteps)
    assert ((other_mel - offline_mel).pow(2).mean().sqrt() / offline_mel.std()).item() > 5 * relative


def test_streaming_mels_equal_upstreams_prepend_and_cut_caches(engine, voice):
    """The engine's chunks (DiT cache in a ring, written in place) against the flow run as upstream runs
    it (each chunk's cache prepended, then cut by ``FlowCache.truncated``), same voice, tokens and noise,
    past the cut and with chunks longer than the prompt (200 frames vs 60): the same mels up to the
    rounding of a different key order."""
    flow, tokens = engine.flow, _tokens(600, seed=11)
    state = engine.start_stream(voice, seed=4)
    noise = FrameNoise(4)   # the stream's own noise, drawn in the same order
    pad = torch.full((1, engine.lookahead), 4218)
    cache = flow.setup_cache(torch.cat([voice.prompt_tokens, pad], dim=1), voice.prompt_mel, voice.speaker_embedding,
                             engine._fixed_noise(voice.prompt_noise), engine.n_timesteps)
    done, sizes = 0, [15, 25, 25, 50, 100, 100, 25, 25, 25, 100]
    for index, size in enumerate(sizes + [None]):
        last = size is None
        window = tokens[done:] if last else tokens[done:done + size + engine.lookahead]
        mine = engine._flow_chunk(state, window, last)
        theirs, cache = flow.inference_chunk(torch.tensor([window]), voice.speaker_embedding, cache, last,
                                             lambda offset, frames: noise.take(frames), engine.n_timesteps)
        cache = cache.truncated(voice.prompt_frames)
        assert mine.shape == theirs.shape
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0, msg=f"chunk {index}")
        done += 0 if last else size
    assert cache.estimator_att.shape[4] == voice.prompt_frames + 100   # the cut was reached
    assert state.flow_cache.estimator_att.entries > 4 * (voice.prompt_frames + 100)   # and the ring went round


def test_two_minute_stream_keeps_state_bounded(engine, voice):
    """3000 tokens = 120 s of audio in 100-token chunks: caches stay at prompt + 100 frames (+ chunk)."""
    state = engine.start_stream(voice, seed=9)
    tokens = _tokens(3000, seed=3)
    total, sizes_seen = 0, []
    prompt_frames = voice.prompt_frames
    total += engine.feed(state, tokens[:18], final=False).size
    at = 18
    while at < len(tokens) - 100:
        total += engine.feed(state, tokens[at:at + 100], final=False).size
        at += 100
        sizes_seen.append(engine.state_nbytes(state))
        start, stop = state.flow_cache.estimator_att.held_positions()
        assert stop - start == prompt_frames + 100   # every chunk of this stream went past the limit
        assert state.flow_cache.estimator_att.kv.shape[4] == engine.cache_width(prompt_frames)
        assert state.flow_cache.conformer_att.shape[3] <= prompt_frames + 100
    tail = engine.feed(state, tokens[at:], final=True)
    assert np.isfinite(tail).all()
    total += tail.size
    assert total == 3000 * SAMPLES_PER_TOKEN
    assert max(sizes_seen[5:]) == min(sizes_seen[5:])  # steady state: memory no longer grows


def test_state_nbytes_counts_the_stream_caches(engine, voice):
    state = engine.start_stream(voice)
    started = engine.state_nbytes(state)
    assert started > state.flow_cache.estimator_att.nbytes()   # the ring is the stream's own from the start
    engine.feed(state, _tokens(40), final=False)
    # then the conformer's caches too (shared with the voice until the first chunk)
    assert engine.state_nbytes(state) > started + state.flow_cache.conformer_att.numel() * 4 - 1


def test_bfloat16_engine_runs(model_dir, single_thread):
    engine = Token2WavEngine.load(model_dir, dtype="bfloat16")
    voice = engine.prepare_voice(*_voice_inputs(0))
    outs = _run_stream(engine, voice, _tokens(40), [20, 20])
    pcm = np.concatenate(outs)
    assert pcm.dtype == np.float32 and pcm.size == 40 * SAMPLES_PER_TOKEN and np.isfinite(pcm).all()


def test_load_rejects_incomplete_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="flow.pt"):
        (tmp_path / "flow.yaml").write_text("flow: 1\n")
        Token2WavEngine.load(tmp_path)


def _check_wav(path: Path, n_tokens: int) -> None:
    with wave.open(str(path)) as wav:
        assert wav.getframerate() == 24000 and wav.getnchannels() == 1 and wav.getsampwidth() == 2
        assert wav.getnframes() == n_tokens * SAMPLES_PER_TOKEN


def test_cli_module_writes_a_24k_wav(model_dir, tmp_path):
    out = tmp_path / "out.wav"
    result = subprocess.run(
        [sys.executable, "-m", "backends.token2wav", "--model-dir", str(model_dir),
         "--tokens", ",".join(str(t) for t in _tokens(25)), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr
    _check_wav(out, 25)


def test_cli_stream_mode_token_file_voice_file_and_bad_ids(model_dir, tmp_path, single_thread, capsys):
    from backends.token2wav.__main__ import main

    tokens_file = tmp_path / "tokens.txt"
    tokens_file.write_text(" ".join(str(t) for t in _tokens(60)))
    prompt_tokens, prompt_mel, spk = _voice_inputs(5)
    np.savez(tmp_path / "voice.npz", prompt_tokens=prompt_tokens, prompt_mel=prompt_mel, speaker_embedding=spk,
             lookahead_pad="repeat")
    out = tmp_path / "stream.wav"
    assert main(["--model-dir", str(model_dir), "--tokens", str(tokens_file), "--voice", str(tmp_path / "voice.npz"),
                 "--out", str(out), "--stream"]) == 0
    _check_wav(out, 60)
    assert main(["--model-dir", str(model_dir), "--tokens", "1,9999", "--out", str(out)]) == 2
    assert "outside the speech token range" in capsys.readouterr().err


def _solo(engine, voice, tokens: list[int], sizes: list[int], seed: int) -> np.ndarray:
    state = engine.start_stream(voice, seed=seed)
    out, at = [], 0
    for i, size in enumerate(sizes):
        out.append(engine.feed(state, tokens[at:at + size], final=i == len(sizes) - 1))
        at += size
    return np.concatenate(out)


@pytest.fixture
def padded_batches(engine):
    """The engine as it runs with CUDA graphs (batches padded to a power of two with filler rows);
    on the CPU the graph wrapper itself falls back to the eager solve."""
    from backends.token2wav.cuda_graph import GraphedCall

    saved = engine.solve, engine.encode
    engine.graphed_solve = engine.solve = GraphedCall(engine.solve)
    engine.encode = GraphedCall(engine.encode)
    yield engine
    engine.graphed_solve = None
    engine.solve, engine.encode = saved


def test_graph_input_buffer_is_shared_per_argument_and_shape_and_counted():
    """The solve's caches are written straight into the graphs' input buffers: one zeroed buffer per
    (argument, shape, dtype), the same object every time, its bytes counted against the budget."""
    from backends.token2wav.cuda_graph import GraphedCall

    graphed = GraphedCall(lambda *args: args)
    first = graphed.input_buffer(6, (2, 3, 4), torch.float16, torch.device("cpu"))
    assert first.shape == (2, 3, 4) and first.dtype == torch.float16 and not first.any()
    first.fill_(1)
    assert graphed.input_buffer(6, (2, 3, 4), torch.float16, torch.device("cpu")) is first
    assert graphed.graph_bytes == first.numel() * 2
    other = graphed.input_buffer(6, (2, 3, 8), torch.float16, torch.device("cpu"))
    assert other is not first and graphed.graph_bytes == (24 + 48) * 2
    assert graphed.input_buffer(5, (2, 3, 4), torch.float16, torch.device("cpu")) is not first
    # laid out as asked: dimension 1 outermost, each of its rows one contiguous block
    row_major = graphed.input_buffer(4, (2, 3, 4), torch.float16, torch.device("cpu"), memory_order=(1, 0, 2))
    assert row_major.shape == (2, 3, 4) and row_major.stride() == (4, 8, 1) and not row_major.any()
    assert row_major[:, 1].is_contiguous()


@pytest.mark.parametrize("padded", [False, True], ids=["exact-batches", "padded-batches"])
def test_feed_many_batches_equal_chunks_and_matches_solo_streams(engine, voice, other_voice, padded, request):
    """Four streams fed together: three of one voice at the same schedule point (one batch of 3,
    padded to 4 with CUDA graphs), one other voice and schedule (its own group). Each stream's audio
    equals its solo run."""
    sizes_a, sizes_c = [18, 25, 50, 7], [20, 9, 30]
    streams = [(voice, _tokens(100, 1), sizes_a, 11), (voice, _tokens(100, 2), sizes_a, 12),
               (voice, _tokens(100, 4), sizes_a, 14), (other_voice, _tokens(59, 3), sizes_c, 13)]
    solo = [_solo(engine, v, t, s, seed) for v, t, s, seed in streams]   # exact shapes, no padding
    encoder_rows: list[int] = []
    if padded:
        request.getfixturevalue("padded_batches")
        graphed_encode = engine.encode

        def encode(embedded, *rest):
            encoder_rows.append(embedded.shape[0])
            return graphed_encode(embedded, *rest)

        engine.encode = encode   # the fixture restores it
    states = [engine.start_stream(v, seed=seed) for v, _, _, seed in streams]
    outputs: list[list[np.ndarray]] = [[] for _ in streams]
    offsets = [0] * len(streams)
    calls = 0
    for step in range(max(len(s) for _, _, s, _ in streams)):
        items, owners = [], []
        for k, (_, tokens, sizes, _) in enumerate(streams):
            if step < len(sizes):
                items.append((states[k], tokens[offsets[k]:offsets[k] + sizes[step]], step == len(sizes) - 1))
                owners.append(k)
                offsets[k] += sizes[step]
        for k, pcm in zip(owners, engine.feed_many(items)):
            assert isinstance(pcm, np.ndarray), pcm
            outputs[k].append(pcm)
        calls += 1
    for k in range(len(streams)):
        joined = np.concatenate(outputs[k])
        assert joined.size == len(streams[k][1]) * SAMPLES_PER_TOKEN
        np.testing.assert_allclose(joined, solo[k], atol=1e-4)  # batched GEMMs round differently
    if padded:  # the group of three ran the encoder as four rows, the lone stream as one
        assert 4 in encoder_rows and set(encoder_rows) <= {1, 2, 4}


def test_feed_many_reports_errors_per_stream(engine, voice):
    good, finished = engine.start_stream(voice, seed=1), engine.start_stream(voice, seed=2)
    engine.feed(finished, _tokens(20), final=True)
    results = engine.feed_many([(good, _tokens(18), False), (finished, _tokens(5), False),
                                (engine.start_stream(voice), [1, 99999], False)])
    assert isinstance(results[0], np.ndarray) and results[0].size > 0
    assert isinstance(results[1], RuntimeError) and "already finished" in str(results[1])
    assert isinstance(results[2], ValueError) and "outside the speech token range" in str(results[2])


@pytest.mark.parametrize("started, pending, final, chunks", [
    (False, 17, False, []),                                  # the first chunk waits for 15 + 3
    (False, 18, False, [(15, False)]),
    (False, 60, False, [(15, False)]),                       # first audio first: the rest waits
    (False, 10, True, [(10, True)]),                         # a short utterance: one last chunk
    (False, 60, True, [(15, False), (25, False), (20, True)]),
    (True, 28, False, [(25, False)]),
    (True, 43, False, [(25, False)]),                        # a catch-up remainder of 15 waits
    (True, 103, False, [(100, False)]),
    (True, 290, False, [(100, False), (100, False), (75, False)]),
    (True, 4, False, [(1, False)]),                          # small pieces come back at once
    (True, 2, True, [(2, True)]),
    (True, 131, True, [(100, False), (25, False), (6, True)]),
])
def test_plan_chunks_uses_canonical_sizes(engine, started, pending, final, chunks):
    """Every non-last chunk after the first is a multiple of 25 tokens up to 100, so a stream that
    fell behind its LLM reuses the shapes (and CUDA graphs) of the schedule instead of making new ones."""
    assert engine.plan_chunks(started, pending, final) == chunks
    consumed = sum(n for n, _ in chunks)
    if final:
        assert consumed == pending
    else:
        assert pending - consumed >= 3   # the lookahead always stays


@pytest.mark.parametrize("padded", [False, True], ids=["exact-batches", "padded-batches"])
def test_streams_at_different_schedule_points_share_one_solve(engine, voice, other_voice, padded, request):
    """Stream b starts one call after stream a (and has a voice of another prompt length), so their
    25-token chunks meet with different estimator cache lengths: they run as one solve over padded,
    masked caches, and each stream's audio still equals its solo run."""
    sizes = [18, 25, 25, 25, 27]
    tokens_a, tokens_b = _tokens(120, 21), _tokens(120, 22)
    solo_a = _solo(engine, voice, tokens_a, sizes, seed=3)   # exact shapes, no padding
    solo_b = _solo(engine, other_voice, tokens_b, sizes, seed=4)
    if padded:   # rows, caches and last chunks padded as with CUDA graphs
        request.getfixturevalue("padded_batches")
    solves: list[tuple[int, bool]] = []
    solve = engine.solve

    def recording_solve(mu, *rest):
        mask = rest[-1]
        solves.append((mu.shape[0], mask is not None and not bool(mask.all())))
        return solve(mu, *rest)

    engine.solve = recording_solve
    try:
        a, b = engine.start_stream(voice, seed=3), engine.start_stream(other_voice, seed=4)
        out_a, out_b, at_a, at_b = [], [], 0, 0
        for step in range(len(sizes) + 1):
            items = []
            if step < len(sizes):
                items.append((a, tokens_a[at_a:at_a + sizes[step]], step == len(sizes) - 1))
                at_a += sizes[step]
            if step >= 1:
                items.append((b, tokens_b[at_b:at_b + sizes[step - 1]], step - 1 == len(sizes) - 1))
                at_b += sizes[step - 1]
            results = engine.feed_many(items)
            if step < len(sizes):
                out_a.append(results.pop(0))
            if step >= 1:
                out_b.append(results.pop(0))
    finally:
        engine.solve = solve
    assert any(rows >= 2 and masked for rows, masked in solves), solves
    np.testing.assert_allclose(np.concatenate(out_a), solo_a, atol=1e-4)
    np.testing.assert_allclose(np.concatenate(out_b), solo_b, atol=1e-4)


def test_feed_many_reports_each_result_as_soon_as_it_is_ready(engine, voice):
    """A first chunk (15 tokens) runs before another stream's 100-token chunk in the same call and is
    reported first; the callback gets exactly what the call returns, once per item."""
    busy = engine.start_stream(voice, seed=1)
    engine.feed(busy, _tokens(18, 1), final=False)
    engine.feed(busy, _tokens(25, 2), final=False)
    fresh = engine.start_stream(voice, seed=2)
    waiting = engine.start_stream(voice, seed=3)
    seen: list[tuple[int, object]] = []
    results = engine.feed_many([(busy, _tokens(100, 3), False), (fresh, _tokens(18, 4), False),
                                (waiting, _tokens(5, 5), False)], on_result=lambda i, r: seen.append((i, r)))
    assert [i for i, _ in seen] == [2, 1, 0]   # nothing to do, then the first chunk, then the long chunk
    assert all(r is results[i] for i, r in seen)
    assert results[0].size == 100 * SAMPLES_PER_TOKEN and results[2].size == 0


def test_warm_up_runs_every_canonical_shape_only_with_cuda_graphs(engine, voice, request):
    """Without graphs there is nothing to capture. With them (here: the graph wrapper, which runs
    eagerly on the CPU) every batch size up to max_rows sees the first chunk, each whole chunk size and
    a padded last chunk twice, so each solve shape reaches the capture threshold before serving. Up to
    8 rows: more than calm_batch_rows, which must not shrink the warm-up's calls."""
    assert engine.calm_batch_rows < 8
    assert engine.warm_up(voice, max_rows=8) == 0
    request.getfixturevalue("padded_batches")
    shapes: list[tuple] = []
    solve = engine.solve

    def recording_solve(mu, *rest):
        shapes.append((mu.shape[0], mu.shape[2]))
        return solve(mu, *rest)

    encoded: list[tuple] = []
    encode, vocode = engine.encode, engine.hift.inference
    vocoded: list[tuple] = []

    def recording_encode(embedded, cnn, att, last):
        encoded.append((embedded.shape[0], embedded.shape[1], att.shape[3], last))
        return encode(embedded, cnn, att, last)

    def recording_vocode(mel, source, *rest, capture=True, **kw):
        vocoded.append((mel.shape[0], mel.shape[2], capture))
        return vocode(mel, source, *rest, capture=capture, **kw)

    engine.solve, engine.encode, engine.hift.inference = recording_solve, recording_encode, recording_vocode
    try:
        calls = engine.warm_up(voice, max_rows=8)
    finally:
        engine.solve, engine.encode = solve, encode
        del engine.hift.inference   # the instance attribute; the class's method is back
    assert calls == 4 * 2 * 6   # batches 1, 2, 4, 8; twice; 18, 25, 50, 75, 100 tokens and the last chunk
    frames = {30, 50, 100, 150, 200, engine.last_chunk_frames}
    assert {(rows, f): shapes.count((rows, f)) for rows in (1, 2, 4, 8) for f in frames} == \
        {(rows, f): 2 for rows in (1, 2, 4, 8) for f in frames}
    # The encoder at every cache length a stream meets and every whole chunk size; last chunks of every
    # length at 1 and 2 rows, encoder and HiFT (each at least twice: captured at the second sighting).
    lengths = engine.encoder_cache_lengths(voice.prompt_frames)
    for rows in (1, 2, 4, 8):
        for length in lengths:
            for size in (25, 50, 75, 100):
                assert encoded.count((rows, size + 3, length, False)) >= 2, (rows, size, length)
    for rows in (1, 2):
        for tokens in range(4, 28):
            assert encoded.count((rows, tokens, lengths[-1], True)) >= 2
            assert vocoded.count((rows, 8 + 2 * tokens, True)) >= 2


def test_last_chunks_never_capture_graphs(engine, voice, padded_batches, monkeypatch):
    """A last chunk has any length: with CUDA graphs its encoder and HiFT calls replay a warm-up graph
    or run eagerly, never capture; other chunks may capture."""
    calls: list[tuple[str, bool]] = []
    graphed = engine.encode
    monkeypatch.setattr(graphed, "replay_only", lambda *args: calls.append(("encode", args[-1])) or graphed(*args),
                        raising=False)
    vocode = engine.hift.inference

    def recording_vocode(*args, capture=True, **kw):
        calls.append(("hift", capture))
        return vocode(*args, capture=capture, **kw)

    monkeypatch.setattr(engine.hift, "inference", recording_vocode)
    state = engine.start_stream(voice, seed=6)
    engine.feed(state, _tokens(18, 6), final=False)
    assert calls == [("hift", True)]                       # a first chunk: capturable
    engine.feed(state, _tokens(10, 7), final=True)
    assert calls[1:] == [("encode", True), ("hift", False)]   # the last chunk: replay-only encoder (last=True), no capture


def test_encoder_cache_lengths_are_the_ones_streams_reach(engine, voice):
    """The warm-up's cache lengths: what a stream's conformer cache holds before each later chunk,
    whichever whole sizes its chunks have."""
    lengths = engine.encoder_cache_lengths(voice.prompt_frames)
    assert lengths[-1] == voice.prompt_frames + 100 and lengths == sorted(lengths)
    seen = set()
    for sizes in ([25, 50, 100], [50, 25, 75], [100, 100]):
        state = engine.start_stream(voice, seed=5)
        engine.feed(state, _tokens(18, 5), final=False)
        for size in sizes:
            seen.add(int(state.flow_cache.conformer_att.shape[3]))
            engine.feed(state, _tokens(size, size), final=False)
        seen.add(int(state.flow_cache.conformer_att.shape[3]))
    assert seen == set(lengths)


@pytest.fixture(autouse=True)
def _fresh_call_costs(engine):
    """Each test starts with no call costs learned (the look-ahead then never shrinks a call), so the
    order a test expects does not hang on how long the tests before it took."""
    engine.call_costs = CallCosts()


def test_feed_batch_runs_first_chunks_first_and_at_most_max_batch_rows(engine, voice):
    """An open batch: a 25-token chunk added first still waits while first chunks are queued, and
    one step takes at most max_batch_rows streams (the oldest)."""
    done: list[int] = []
    started = engine.start_stream(voice, seed=1)
    engine.feed(started, _tokens(18, 1), final=False)
    saved = engine.max_batch_rows
    engine.max_batch_rows = 2
    try:
        batch = engine.feed_batch(lambda key, result: done.append(key))
        batch.add(0, started, _tokens(25, 2), False)
        for key in (1, 2, 3):
            batch.add(key, engine.start_stream(voice, seed=key + 1), _tokens(18, key + 2), False)
        assert batch.step() and done == [1, 2]
        assert batch.step() and done == [1, 2, 3]
        assert not batch.step() and done == [1, 2, 3, 0]
    finally:
        engine.max_batch_rows = saved


class _Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _started(engine, voice, seed: int):
    state = engine.start_stream(voice, seed=seed)
    engine.feed(state, _tokens(18, seed), final=False)
    return state


def test_feed_batch_tracks_each_listeners_playback(engine, voice):
    """played_until follows the bench's listener: real-time playback from the first audio, a stall
    restarting it from the audio that ended it."""
    clock = _Clock(100.0)
    state = engine.start_stream(voice, seed=3)
    batch = engine.feed_batch(lambda key, result: outs.append(result), clock=clock)
    outs: list[np.ndarray] = []
    batch.add(0, state, _tokens(18, 3), False)
    while batch.step():
        pass
    first = outs[0].size / 24000
    assert first > 0 and state.played_until == pytest.approx(100.0 + first)
    clock.now = 100.1                      # audio left: the next chunk queues behind it
    batch.add(1, state, _tokens(25, 4), False)
    while batch.step():
        pass
    assert state.played_until == pytest.approx(100.0 + first + outs[1].size / 24000)
    clock.now = 200.0                      # a stall: playback resumes at this chunk's arrival
    batch.add(2, state, _tokens(25, 5), False)
    while batch.step():
        pass
    assert state.played_until == pytest.approx(200.0 + outs[2].size / 24000)


def test_feed_batch_serves_the_listener_about_to_run_dry_first(engine, voice):
    """Earliest deadline first: of two started streams, the one whose audio runs out sooner goes first,
    whatever the arrival order, and its chunk size picks the call (the other size waits)."""
    clock = _Clock(100.0)
    relaxed, pressed = _started(engine, voice, 11), _started(engine, voice, 12)
    relaxed.played_until, pressed.played_until = 105.0, 100.2
    done: list[int] = []
    batch = engine.feed_batch(lambda key, result: done.append(key), clock=clock)
    batch.add(0, relaxed, _tokens(25, 13), False)    # arrives first, one size ...
    batch.add(1, pressed, _tokens(50, 14), False)    # ... runs out first, another size
    assert batch.step() and done == [1]
    assert not batch.step() and done == [1, 0]


def test_a_listener_about_to_stall_goes_before_a_new_first_chunk(engine, voice):
    """First chunks go ahead of listeners with audio to spare, not of one that has run dry."""
    clock = _Clock(100.0)
    stalled, relaxed = _started(engine, voice, 50), _started(engine, voice, 51)
    stalled.played_until, relaxed.played_until = 99.5, 104.0
    done: list[int] = []
    batch = engine.feed_batch(lambda key, result: done.append(key), clock=clock)
    batch.add(0, relaxed, _tokens(25, 52), False)
    batch.add(1, engine.start_stream(voice, seed=53), _tokens(18, 53), False)
    batch.add(2, stalled, _tokens(50, 54), False)
    assert batch.step() and done == [2]        # ran dry half a second ago
    assert batch.step() and done == [2, 1]     # the new stream's first chunk
    assert not batch.step() and done == [2, 1, 0]


def test_feed_batch_keeps_calls_small_while_every_listener_has_audio(engine, voice):
    """While the most urgent stream has calm_slack_s of audio left and no backlog waits, a call takes
    calm_batch_rows streams (a first chunk arriving meanwhile waits for a shorter call); once one runs
    short, or more feeds wait than one full call takes, max_batch_rows."""
    clock = _Clock(100.0)
    states = [_started(engine, voice, 20 + i) for i in range(5)]
    saved = engine.max_batch_rows, engine.calm_batch_rows, engine.calm_slack_s
    engine.max_batch_rows, engine.calm_batch_rows, engine.calm_slack_s = 5, 2, 1.0
    try:
        for i, state in enumerate(states):
            state.played_until = 103.0 + 0.1 * i  # seconds of audio everywhere
        done: list[int] = []
        batch = engine.feed_batch(lambda key, result: done.append(key), clock=clock)
        for i, state in enumerate(states):
            batch.add(i, state, _tokens(25, 30 + i), False)
        assert batch.step() and done == [0, 1]            # calm: 2 rows, the most urgent
        clock.now = 102.5                                 # stream 2 has 0.7 s left: urgent
        assert not batch.step() and done == [0, 1, 2, 3, 4]   # up to 5 rows: all three left
        # A backlog (more feeds than one full call takes) ends calm calls too, however much audio is left.
        states.append(_started(engine, voice, 26))
        for i, state in enumerate(states):
            state.played_until = 110.0
            batch.add(10 + i, state, _tokens(25, 40 + i), False)
        assert batch.step() and done[5:] == [10, 11, 12, 13, 14]
    finally:
        engine.max_batch_rows, engine.calm_batch_rows, engine.calm_slack_s = saved


@pytest.mark.parametrize("lookahead", [True, False])
def test_feed_batch_takes_fewer_rows_when_a_full_call_would_make_another_size_late(engine, voice, lookahead):
    """The look-ahead (backends.token2wav.scheduling) with the call costs seen so far: a full call of
    50-token chunks would end after a 25-token listener's deadline, so the call takes 2 streams; the
    25-token chunk goes next, then the rest. Switched off (deadline_lookahead 0), the full call runs."""
    clock = _Clock(100.0)
    states = [_started(engine, voice, 60 + i) for i in range(5)]
    saved = engine.max_batch_rows, engine.calm_batch_rows, engine.call_costs, engine.deadline_lookahead
    engine.max_batch_rows = engine.calm_batch_rows = 4
    engine.deadline_lookahead = lookahead
    engine.call_costs = costs = CallCosts()
    for rows, seconds in ((1, 0.05), (2, 0.1), (4, 0.2)):
        costs.observe((50, False), rows, seconds)
        costs.observe((25, False), rows, seconds)
    try:
        for state, until in zip(states, (100.15, 100.3, 105.0, 105.0, 100.22)):
            state.played_until = until
        done: list[int] = []
        batch = engine.feed_batch(lambda key, result: done.append(key), clock=clock)
        for i, state in enumerate(states[:4]):
            batch.add(i, state, _tokens(50, 70 + i), False)
        batch.add(4, states[4], _tokens(25, 74), False)
        if lookahead:
            assert batch.step() and done == [0, 1]       # 4 rows would end at 100.2 + 0.05 > 100.22
            assert batch.step() and done == [0, 1, 4]
            assert not batch.step() and done == [0, 1, 4, 2, 3]
        else:
            assert batch.step() and done == [0, 1, 2, 3]
            assert not batch.step() and done == [0, 1, 2, 3, 4]
    finally:
        engine.max_batch_rows, engine.calm_batch_rows, engine.call_costs, engine.deadline_lookahead = saved


def test_feed_batch_learns_the_cost_of_each_call_size(engine, voice):
    """Each settled call's duration goes into engine.call_costs under its chunk key and rows; the time
    spent sending answers does not."""
    saved = engine.call_costs
    engine.call_costs = CallCosts()
    try:
        batch = engine.feed_batch(lambda key, result: time.sleep(0.2))   # a slow answer
        batch.add(0, engine.start_stream(voice, seed=80), _tokens(18, 80), False)
        began = time.monotonic()
        batch.step()
        wall = time.monotonic() - began
        assert 0 < engine.call_costs.estimate((15, False), 1) <= wall - 0.2
        assert engine.call_costs.estimate((25, False), 1) == 0.0   # no other size ran
    finally:
        engine.call_costs = saved


def test_on_call_reports_every_engine_call(engine, voice):
    """The call trace: one record per call, with its size, kind, waits and the listeners' slack."""
    clock = _Clock(100.0)
    records = []
    engine.on_call = records.append
    try:
        state = engine.start_stream(voice, seed=40)
        outs: list[np.ndarray] = []

        def answer(key, result) -> None:   # sending an answer takes 30 ms of the batch's clock
            outs.append(result)
            clock.now += 0.03

        batch = engine.feed_batch(answer, clock=clock)
        batch.add(0, state, _tokens(18, 40), False)
        clock.now = 100.25                     # the feed waited 250 ms before its call
        batch.step()
        batch.add(1, state, _tokens(60, 41), True)   # 15 + 60 tokens: a 50-token chunk, then the last one
        while batch.step():
            pass
    finally:
        engine.on_call = None
    first, middle, last = records
    assert (first.first, first.rows, first.tokens, first.settled) == (True, 1, 15, 1)
    assert first.slack_s == pytest.approx(0.1 - 0.25)   # a first chunk is due 100 ms after it arrived
    assert first.waited_s == pytest.approx(0.25)
    assert first.reply_s == pytest.approx(0.03) and first.seconds >= first.reply_s
    assert middle.reply_s == 0 and (first.captured, first.eager) == (0, 0)   # no answer; no graphs on a CPU
    assert (middle.first, middle.last, middle.tokens, middle.settled) == (False, False, 50, 0)
    assert middle.slack_s == pytest.approx(outs[0].size / 24000 - 0.03)   # the first chunk's audio, less 30 ms
    assert (last.last, last.settled) == (True, 1)
    assert "rows=1" in last.line() and "last" in last.line()


def test_compile_switch_never_compiles_cpu_work(model_dir, monkeypatch):
    """compile_fused is for CUDA tensors only: a CPU engine leaves the switch off, and even with the
    switch on, CPU tensors run the eager functions (a CPU box may have no compiler for inductor)."""
    from backends.token2wav import fused

    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile was called for CPU work")

    monkeypatch.setattr(torch, "compile", no_compile)
    Token2WavEngine.load(model_dir, compile_fused=True)
    assert not fused.is_compiled()
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    gate, scale, shift = torch.randn(8), torch.randn(8), torch.randn(8)
    fused.use_compiled(True)
    try:
        summed, normed = fused.gated_norm(x, y, gate, scale, shift, 1e-6)
    finally:
        fused.use_compiled(False)
    torch.testing.assert_close(summed, x + gate * y)
    torch.testing.assert_close(normed, torch.nn.functional.layer_norm(x + gate * y, (8,), scale, shift, 1e-6))


def test_last_chunks_run_encoder_and_hift_in_groups_the_warm_up_captured(engine, voice, padded_batches, monkeypatch):
    """With CUDA graphs, five streams ending with equal last chunks run the encoder and HiFT in groups of
    at most LAST_CHUNK_GRAPH_ROWS (the warm-up's last-chunk graphs; a larger group ran eagerly), and
    the audio is what each stream gets alone."""
    from backends.token2wav.engine import LAST_CHUNK_GRAPH_ROWS

    alone = []
    for k in range(5):
        state = engine.start_stream(voice, seed=30 + k)
        engine.feed(state, _tokens(18, k), final=False)
        alone.append(engine.feed(state, _tokens(10, 10 + k), final=True))
    rows: list[tuple[str, int]] = []
    graphed = engine.encode
    monkeypatch.setattr(graphed, "replay_only", lambda *args: rows.append(("encode", args[0].shape[0])) or graphed(*args),
                        raising=False)
    vocode = engine.hift.inference

    def recording_vocode(mel, *args, capture=True, **kw):
        if not capture:
            rows.append(("hift", mel.shape[0]))
        return vocode(mel, *args, capture=capture, **kw)

    monkeypatch.setattr(engine.hift, "inference", recording_vocode)
    states = [engine.start_stream(voice, seed=30 + k) for k in range(5)]
    engine.feed_many([(state, _tokens(18, k), False) for k, state in enumerate(states)])
    together = engine.feed_many([(state, _tokens(10, 10 + k), True) for k, state in enumerate(states)])
    for part in ("encode", "hift"):
        sizes = [n for name, n in rows if name == part]
        assert sizes and max(sizes) <= LAST_CHUNK_GRAPH_ROWS and sum(sizes) == 5, (part, sizes)
    for mine, solo in zip(together, alone):
        assert mine.shape == solo.shape
        np.testing.assert_allclose(mine, solo, atol=2e-4)
