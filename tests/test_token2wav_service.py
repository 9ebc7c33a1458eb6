"""Unit tests of the token2wav sequence table (no Triton, no torch): a counting fake engine stands in."""

from __future__ import annotations

import numpy as np
import pytest

from backends.token2wav.service import (
    BadRequest,
    ChunkRequest,
    ServiceConfig,
    Token2WavService,
    Token2WavServiceError,
    Unavailable,
    VoiceCache,
    VoiceTensors,
    parameter_env,
)
from gateway.voices import conditioning_hash


class CountingFakeEngine:
    """Test double: 'PCM' is one sample per token; counts voice preparations; optional failure."""

    sample_rate = 24000

    def __init__(self) -> None:
        self.prepared = 0
        self.fail_feed = False

    def prepare_voice(self, prompt_tokens, prompt_mel, speaker_embedding, lookahead_pad="silence"):
        self.prepared += 1
        return {"tokens": prompt_tokens.copy()}

    def start_stream(self, voice, seed=0):
        return {"voice": voice, "seed": seed, "fed": 0}

    def feed(self, state, tokens, final):
        if self.fail_feed:
            raise RuntimeError("boom")
        state["fed"] += len(tokens)
        return np.full(len(tokens), state["seed"], np.float32)

    def state_nbytes(self, state):
        return 1024 * (1 + state["fed"])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_voice(seed: int, length: int = 6) -> tuple[str, VoiceTensors]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6561, length).astype(np.int32)
    mel = rng.standard_normal((2 * length, 80)).astype(np.float32)
    emb = rng.standard_normal(192).astype(np.float32)
    voice = VoiceTensors(tokens[None], mel[None], emb[None], "silence")  # wire shapes
    return conditioning_hash(tokens, mel, emb, "silence"), voice


def start(cid: int, voice_id: str, voice: VoiceTensors | None, tokens=(1, 2, 3), seed: int = 0, end=False) -> ChunkRequest:
    return ChunkRequest(cid, start=True, end=end, tokens=np.array([tokens], np.int32).reshape(1, -1),
                        voice_id=voice_id, voice=voice, seed=seed)


def chunk(cid: int, tokens=(4, 5), end=False, abort=False) -> ChunkRequest:
    return ChunkRequest(cid, start=False, end=end, tokens=np.array(tokens, np.int32).reshape(1, -1), abort=abort)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine() -> CountingFakeEngine:
    return CountingFakeEngine()


@pytest.fixture
def service(engine, clock) -> Token2WavService:
    return Token2WavService(engine, ServiceConfig(max_live_streams=3, stream_ttl_s=10, voice_cache_size=2), clock=clock)


def test_stream_lifecycle_frees_on_end(service):
    vid, voice = make_voice(1)
    first = service.handle(start(7, vid, voice, seed=3))
    assert first.live_sequences == 1 and first.pcm.tolist() == [3, 3, 3]
    last = service.handle(chunk(7, (9,), end=True))
    assert last.live_sequences == 0 and last.pcm.tolist() == [3]
    with pytest.raises(BadRequest, match="needs START"):
        service.handle(chunk(7))


def test_probe_reports_live_count_without_a_voice(service):
    vid, voice = make_voice(1)
    service.handle(start(1, vid, voice))
    probe = service.handle(ChunkRequest(99, start=True, end=True, tokens=np.zeros((1, 0), np.int32)))
    assert probe.live_sequences == 1 and probe.pcm.size == 0


def test_abort_frees_at_once_and_is_idempotent(service):
    vid, voice = make_voice(1)
    service.handle(start(1, vid, voice))
    assert service.handle(chunk(1, (), abort=True)).live_sequences == 0
    assert service.handle(chunk(1, (), abort=True)).live_sequences == 0
    assert service.stats.aborted == 1


def test_reaper_frees_idle_streams_only(service, clock):
    vid, voice = make_voice(1)
    service.handle(start(1, vid, voice))
    clock.now += 6
    service.handle(start(2, vid, voice))
    clock.now += 5  # stream 1 idle 11 s > TTL 10 s, stream 2 idle 5 s
    assert service.reap_idle() == 1
    assert service.live_sequences() == 1
    with pytest.raises(BadRequest):
        service.handle(chunk(1))
    service.handle(chunk(2, end=True))
    assert service.live_sequences() == 0


def test_capacity_by_count_is_unavailable_and_recovers(service):
    vid, voice = make_voice(1)
    for cid in (1, 2, 3):
        service.handle(start(cid, vid, voice))
    with pytest.raises(Unavailable) as info:
        service.handle(start(4, vid, voice))
    assert str(info.value).startswith("[token2wav:unavailable]")
    service.handle(chunk(1, (), abort=True))
    assert service.handle(start(4, vid, voice)).live_sequences == 3


def test_capacity_by_state_bytes(engine, clock):
    svc = Token2WavService(engine, ServiceConfig(max_live_streams=100, max_state_mib=3 * 4096 / 2**20), clock=clock)
    vid, voice = make_voice(1)
    for cid in (1, 2, 3):  # 3 tokens fed -> 4 KiB each
        svc.handle(start(cid, vid, voice))
    assert svc.live_state_bytes() == 3 * 4096
    with pytest.raises(Unavailable, match="MiB"):
        svc.handle(start(4, vid, voice))


def test_voice_cache_hit_skips_tensors_and_lru_evicts(service, engine):
    ids = [make_voice(s) for s in (1, 2, 3)]
    for cid, (vid, voice) in enumerate(ids):
        service.handle(start(cid, vid, voice, end=True))
    assert engine.prepared == 3 and len(service.voices) == 2
    service.handle(start(10, ids[2][0], None, end=True))  # cached: no tensors needed
    assert engine.prepared == 3
    with pytest.raises(BadRequest, match="unknown voice"):  # evicted (LRU of 2)
        service.handle(start(11, ids[0][0], None))
    assert service.live_sequences() == 0


def test_hash_mismatch_and_bad_voice_shapes_are_rejected(service):
    vid, voice = make_voice(1)
    with pytest.raises(BadRequest, match="does not match"):
        service.handle(start(1, "0" * 64, voice))
    bad = VoiceTensors(voice.prompt_tokens, voice.prompt_mel[:, :-2], voice.speaker_embedding)
    with pytest.raises(BadRequest, match="prompt_mel"):
        service.handle(start(1, vid, bad))
    with pytest.raises(BadRequest, match="voice_id"):
        service.handle(start(1, None, voice))  # type: ignore[arg-type]
    assert service.live_sequences() == 0


@pytest.mark.parametrize("tokens", [(6561,), (-1,), (1, 2, 99999)])
def test_out_of_range_tokens_fail_and_free_the_stream(service, tokens):
    vid, voice = make_voice(1)
    service.handle(start(1, vid, voice))
    with pytest.raises(BadRequest, match="0..6560"):
        service.handle(chunk(1, tokens))
    assert service.live_sequences() == 0


def test_float_tokens_rejected(service):
    vid, voice = make_voice(1)
    request = start(1, vid, voice)
    request.tokens = request.tokens.astype(np.float32)
    with pytest.raises(BadRequest, match="dtype"):
        service.handle(request)


def test_engine_failure_frees_the_stream(service, engine):
    vid, voice = make_voice(1)
    service.handle(start(1, vid, voice))
    engine.fail_feed = True
    with pytest.raises(Token2WavServiceError, match="engine failed"):
        service.handle(chunk(1))
    assert service.live_sequences() == 0


def test_restart_and_cancel(service):
    vid, voice = make_voice(1)
    service.handle(start(1, vid, voice))
    assert service.handle(start(1, vid, voice)).live_sequences == 1  # START again replaces the stream
    assert service.cancel(1) and service.live_sequences() == 0
    assert not service.cancel(1)


def test_reaper_thread_runs(engine):
    svc = Token2WavService(engine, ServiceConfig(stream_ttl_s=0.0))
    vid, voice = make_voice(1)
    svc.handle(start(1, vid, voice))
    svc.start_reaper(interval_s=0.01)
    try:
        import time

        deadline = time.monotonic() + 30
        while svc.live_sequences() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert svc.live_sequences() == 0 and svc.stats.reaped == 1
    finally:
        svc.close()


def test_parameters_from_config_and_env():
    config = ServiceConfig.from_parameters(
        {"model_dir": "/m", "max_live_streams": "5", "stream_ttl_s": "2.5", "device": ""},
        environ={"TOKEN2WAV_MAX_LIVE_STREAMS": "7"},
    )
    assert (config.model_dir, config.max_live_streams, config.stream_ttl_s, config.device) == ("/m", 7, 2.5, "cpu")
    assert parameter_env(stream_ttl_s=1) == {"TOKEN2WAV_STREAM_TTL_S": "1"}
    with pytest.raises(ValueError):
        parameter_env(nonsense=1)


def test_voice_cache_capacity():
    cache = VoiceCache(2)
    cache.put("a", 1), cache.put("b", 2)
    assert cache.get("a") == 1  # a is now most recent
    cache.put("c", 3)
    assert "b" not in cache and "a" in cache and "c" in cache


class BatchFakeEngine(CountingFakeEngine):
    """Test double with ``feed_batch``: each ``step`` finishes the oldest feed (``all_reversed``:
    every feed, newest first)."""

    def __init__(self, all_reversed: bool = False) -> None:
        super().__init__()
        self.all_reversed = all_reversed

    def feed_batch(self, on_result):
        engine = self

        class Batch:
            def __init__(self):
                self.queue = []

            @property
            def pending(self):
                return bool(self.queue)

            def add(self, key, state, tokens, final):
                self.queue.append((key, state, tokens, final))

            def step(self):
                done = list(reversed(self.queue)) if engine.all_reversed else self.queue[:1]
                for item in done:
                    self.queue.remove(item)
                    key, state, tokens, final = item
                    on_result(key, engine.feed(state, tokens, final))
                return self.pending

        return Batch()


def test_handle_many_answers_each_request_when_its_result_is_ready(clock):
    """The service passes the engine's early results on at once (mapped to request positions), and
    answers requests that need no engine work (probes, errors) before any engine work."""
    service = Token2WavService(BatchFakeEngine(all_reversed=True), ServiceConfig(max_live_streams=8), clock=clock)
    voice_id, voice = make_voice(0)
    service.handle(start(1, voice_id, voice))
    service.handle(start(2, voice_id, None))
    order: list[int] = []
    results = service.handle_many([chunk(1, (7, 8, 9)), ChunkRequest(99, start=True, end=True, tokens=np.zeros((1, 0), np.int32)),
                                   chunk(2, (1,), end=True), chunk(3)], on_result=lambda i, r: order.append(i))
    assert order == [1, 3, 2, 0]   # probe and unknown stream first, then the engine's reverse order
    assert results[0].pcm.size == 3 and results[2].pcm.size == 1
    assert isinstance(results[3], BadRequest)
    assert service.live_sequences() == 1   # stream 2 ended


def test_warm_up_uses_a_synthetic_voice_of_the_configured_length(clock):
    """Off by default; with warmup_prompt_tokens the engine's warm_up gets a voice of that many prompt
    tokens (and the batch limit); engines without warm_up are left alone."""

    class WarmingEngine(CountingFakeEngine):
        def __init__(self):
            super().__init__()
            self.warmed = []

        def warm_up(self, voice, max_rows):
            self.warmed.append((len(voice["tokens"]), max_rows))
            return 7

    engine = WarmingEngine()
    assert Token2WavService(engine, ServiceConfig(), clock=clock).warm_up(max_rows=16) == 0
    service = Token2WavService(engine, ServiceConfig(warmup_prompt_tokens=150), clock=clock)
    assert service.warm_up(max_rows=16) == 7
    assert engine.warmed == [(150, 16)]
    assert Token2WavService(CountingFakeEngine(), ServiceConfig(warmup_prompt_tokens=150), clock=clock).warm_up(4) == 0


def test_worker_answers_submitted_requests_in_stream_order(clock):
    """submit returns at once; the worker answers every request from its thread, and a stream's
    second and third requests wait for its first (no 'already has a request in flight' error)."""
    import threading

    service = Token2WavService(BatchFakeEngine(), ServiceConfig(max_live_streams=8), clock=clock)
    voice_id, voice = make_voice(0)
    service.handle(start(1, voice_id, voice))
    answers: dict[int, object] = {}
    threads: set[str] = set()
    done = threading.Event()

    def on_result(index, result):
        answers[index] = result
        threads.add(threading.current_thread().name)
        if len(answers) == 5:
            done.set()

    service.start_worker()
    try:
        service.submit([chunk(1, (1, 2)), chunk(1, (3,)), start(2, voice_id, None, tokens=(5, 6, 7)),
                        chunk(1, (4,), end=True), chunk(9)], on_result)
        assert done.wait(10), answers
    finally:
        service.close()
    assert [answers[i].pcm.size for i in range(4)] == [2, 1, 3, 1]
    assert isinstance(answers[4], BadRequest)
    assert threads == {"token2wav-answers"}
    assert service.live_sequences() == 0   # close() drops stream 2 too; stream 1 ended


def test_a_slow_answer_does_not_hold_up_the_next_engine_call(clock):
    """Answers go out from their own thread (Triton's send is an IPC round trip): while one request's
    answer is still being sent, the worker already runs the next stream's chunk."""
    import threading
    import time

    engine = BatchFakeEngine()
    fed_at: dict[int, float] = {}
    feed = engine.feed

    def timed_feed(state, tokens, final):
        fed_at[state["seed"]] = time.monotonic()
        return feed(state, tokens, final)

    engine.feed = timed_feed
    service = Token2WavService(engine, ServiceConfig(max_live_streams=8), clock=clock)
    voice_id, voice = make_voice(0)
    service.handle(start(1, voice_id, voice, seed=1))
    service.handle(start(2, voice_id, voice, seed=2))
    fed_at.clear()
    answered = threading.Event()
    count = 0

    def on_result(index, result):
        nonlocal count
        if index == 0:
            time.sleep(0.5)          # a slow send
        count += 1
        if count == 2:
            answered.set()

    service.start_worker()
    try:
        service.submit([chunk(1, (1, 2)), chunk(2, (3,))], on_result)
        assert answered.wait(10)
    finally:
        service.close()
    assert fed_at[2] - fed_at[1] < 0.4, fed_at   # stream 2 ran while stream 1's answer was going out


def test_worker_survives_an_unexpected_failure_and_serves_the_next_request(clock, monkeypatch):
    """A bug while admitting a request (here: a RuntimeError from inside the service) answers that
    request with an internal error; the worker thread goes on and serves the next one."""
    import threading

    service = Token2WavService(BatchFakeEngine(), ServiceConfig(max_live_streams=8), clock=clock)
    begin = service._begin

    def flaky_begin(request):
        if request.correlation_id == 1:
            raise RuntimeError("a bug")
        return begin(request)

    monkeypatch.setattr(service, "_begin", flaky_begin)
    voice_id, voice = make_voice(0)
    answers: dict[int, object] = {}
    done = threading.Event()

    def on_result(index, result):
        answers[index] = result
        if len(answers) == 2:
            done.set()

    service.start_worker()
    try:
        service.submit([start(1, voice_id, voice), start(2, voice_id, voice, tokens=(5, 6))], on_result)
        assert done.wait(10), answers
    finally:
        service.close()
    assert isinstance(answers[0], Token2WavServiceError) and "a bug" in str(answers[0])
    assert answers[1].pcm.size == 2
