"""Streaming token2wav engine: speech tokens (25 Hz) -> 24 kHz float32 PCM, one explicit state per stream.

Call sequence (mirrors the Step-Audio2 ``token2wav.py`` wrapper, without its globals):

    engine = Token2WavEngine.load("token2wav/", device="cuda", dtype="float16")
    voice = engine.prepare_voice(prompt_tokens, prompt_mel, speaker_embedding)   # once per voice, cacheable
    state = engine.start_stream(voice, seed=7)                                    # once per utterance
    pcm = engine.feed(state, tokens, final=False)   # ... repeated; final=True flushes

Streaming rules:
- The flow needs ``pre_lookahead_len`` (3) future tokens for every token it turns into mel, so a
  non-final ``feed`` never synthesises the last 3 buffered tokens, and the first one waits until
  15 + 3 tokens are buffered (returns an empty array until then). Of the rest it synthesises whole
  chunks of canonical sizes (``plan_chunks``: 15 first, then multiples of 25 up to 100); a shorter
  remainder waits for the next call. ``final=True`` synthesises everything, the last chunk with the
  lookahead replaced by zero padding as upstream does.
- Every synthesised token gives 2 mel frames = 960 samples. HiFT output is held back by 8 mel frames
  (3840 samples) to cross-fade with the next call (Hamming window, as upstream), so a stream of N tokens
  yields exactly N * 960 samples in total once flushed.
- Attention caches keep exactly the frames upstream keeps after each chunk (``FlowCache.truncated``;
  the DiT's in a fixed-width ring, ``DiTCacheRing``), so memory per stream is bounded however long the
  utterance is.

Noise and independence: the flow's starting noise is drawn per absolute mel frame from a generator
owned by the stream (seeded by ``seed``), in fixed 50-frame blocks, so output does not depend on the
chunking or on other streams; the voice's prompt frames use noise from a fixed voice seed. HiFT's NSF
noise comes from a second per-stream generator. Offline ``synthesize(voice, tokens, seed)`` uses the
same frame noise as a stream with the same seed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from backends.token2wav import fused
from backends.token2wav.config import load_flow
from backends.token2wav.cuda_graph import GraphedCall, zeros_in_memory_order
from backends.token2wav.dit_cache import DiTCacheRing
from backends.token2wav.flow import CausalMaskedDiffWithXvec, keep_prompt_and_recent
from backends.token2wav.hift import HiFTGenerator, load_hift
from backends.token2wav.scheduling import CallCosts, Due, graph_rows, powers_of_two_down, rows_keeping_deadlines

SAMPLE_RATE = 24000
NUM_SPEECH_TOKENS = 6561          # FSQ codes 0..6560
SILENCE_TOKEN = 4218              # Step-Audio2's lookahead pad when preparing a voice
FIRST_CHUNK_TOKENS = 15           # tokens synthesised by the first streaming call (+ lookahead)
CHUNK_QUANTUM_TOKENS = 25         # later chunks are multiples of this (see plan_chunks) ...
MAX_CHUNK_TOKENS = 100            # ... of at most this many tokens
CACHE_WIDTH_STEP = 100            # DiT cache rings are a multiple of this wide (frames): few solve shapes
HIFT_CACHE_FRAMES = 8             # mel frames re-fed to HiFT for the cross-fade (160 ms)
CACHE_RECENT_FRAMES = 100         # frames kept besides the prompt when truncating caches
SOLVE_CNN_ARG, SOLVE_ATT_ARG = 5, 6  # positions of the estimator caches in ``Token2WavEngine.solve``'s arguments
#: How the solve's batch of attention caches (steps, depth, 2*rows, heads, width, 2*head_dim) lies in memory,
#: outermost dimension first: row-major, each row's (steps, depth, heads, width, 2*head_dim) contiguous.
SOLVE_ATT_ORDER = (2, 0, 1, 3, 4, 5)
LAST_CHUNK_GRAPH_ROWS = 2         # with CUDA graphs, last chunks run encoder and HiFT in groups of at most this many
VOICE_NOISE_SEED = 0x5EED         # noise for the prompt frames of every voice (fixed: voices are shared)
NOISE_BLOCK_FRAMES = 50           # frame noise is drawn in blocks of this size (chunking-independent)
N_TIMESTEPS = 10
#: A new stream's first chunk goes ahead of every listener with more audio left than this, after it
#: arrived (FeedBatch: earliest deadline first); a listener closer to running dry goes first.
FIRST_CHUNK_SLACK_S = 0.1

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

TokensLike = Union[Sequence[int], np.ndarray, torch.Tensor]


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, float16, bfloat16") from None


def validate_tokens(tokens: TokensLike, what: str = "tokens") -> list[int]:
    """Speech token ids as a list of ints; ValueError for non-integers or ids outside 0..6560."""
    array = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
    if array.size == 0:
        return []
    if array.ndim != 1:
        array = array.reshape(-1) if array.ndim == 2 and array.shape[0] == 1 else array
    if array.ndim != 1:
        raise ValueError(f"{what} must be a 1-D sequence of ids, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{what} must be integer speech token ids, got dtype {array.dtype}")
    bad = np.flatnonzero((array < 0) | (array >= NUM_SPEECH_TOKENS))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}[{i}] = {int(array[i])} is outside the speech token range 0..{NUM_SPEECH_TOKENS - 1}")
    return [int(x) for x in array]


def _float_array(value: Any, what: str) -> torch.Tensor:
    tensor = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    if not tensor.is_floating_point():
        raise ValueError(f"{what} must be floating point, got {tensor.dtype}")
    tensor = tensor.float()
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{what} contains NaN or infinite values")
    return tensor


class FrameNoise:
    """Standard-normal flow noise indexed by absolute mel frame, from a generator owned by one stream.

    Drawn in fixed blocks of NOISE_BLOCK_FRAMES frames x 80 bins, so the noise of frame k does not
    depend on how the frames are requested (one offline call or many streaming chunks).
    """

    def __init__(self, seed: int, channels: int = 80):
        self.generator = torch.Generator().manual_seed(int(seed))
        self.channels = channels
        self.buffer = torch.empty(0, channels)

    def take(self, n_frames: int) -> torch.Tensor:
        """The next n_frames frames as (1, channels, n_frames) float32 on the CPU."""
        while self.buffer.shape[0] < n_frames:
            block = torch.randn(NOISE_BLOCK_FRAMES, self.channels, generator=self.generator)
            self.buffer = torch.cat([self.buffer, block])
        frames, self.buffer = self.buffer[:n_frames], self.buffer[n_frames:]
        return frames.t().unsqueeze(0).contiguous()


@dataclass
class StreamCaches:
    """The flow's streaming caches as the engine keeps them: the conformer's and the DiT convs' in
    upstream's layout (``FlowCache``), the DiT attention's as a ``DiTCacheRing``. A stream's caches are
    its own tensors (never views of a batch), except those it still shares with its voice."""

    conformer_cnn: torch.Tensor    # (1, C, 2 + 2*up_stride)
    conformer_att: torch.Tensor    # (blocks + up_blocks, 1, heads, T, 2*d_k), oldest first
    estimator_cnn: torch.Tensor    # (steps, depth, 2, 2*hidden, 2)
    estimator_att: DiTCacheRing

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.conformer_cnn, self.conformer_att, self.estimator_cnn, self.estimator_att.kv

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(frozen=True)
class VoiceConditioning:
    """Everything reusable for one voice; read-only after prepare_voice, safe to share between streams."""

    prompt_tokens: torch.Tensor        # (1, Tp) int64, device
    prompt_mel: torch.Tensor           # (1, 2*Tp, 80), device, model dtype
    speaker_embedding: torch.Tensor    # (1, 192), device, model dtype
    projected_speaker: torch.Tensor    # (1, 80), device, model dtype
    prompt_noise: torch.Tensor         # (1, 80, 2*Tp) float32 CPU: the noise used for the prompt frames
    prompt_cache: StreamCaches         # flow caches after the prompt (+ lookahead pad); streams copy the ring
    lookahead_pad: str                 # "silence" or "repeat"

    @property
    def prompt_frames(self) -> int:
        return int(self.prompt_mel.shape[1])

    def nbytes(self) -> int:
        tensors = (self.prompt_tokens, self.prompt_mel, self.speaker_embedding, self.projected_speaker, self.prompt_noise)
        return self.prompt_cache.nbytes() + sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class StreamState:
    """Per-utterance state. Owned by exactly one stream; dropping it frees everything it holds."""

    voice: VoiceConditioning
    seed: int
    flow_noise: FrameNoise
    hift_generator: torch.Generator
    flow_cache: Optional[StreamCaches]
    pending: list[int] = field(default_factory=list)   # fed but not yet synthesised (incl. lookahead)
    started: bool = False                               # first chunk synthesised
    finished: bool = False
    hift_mel: Optional[torch.Tensor] = None             # (1, 80, <=8) last mel frames
    hift_source: Optional[torch.Tensor] = None          # (1, 1, <=3840) last excitation samples
    hift_speech: Optional[torch.Tensor] = None          # (1, <=3840) held-back samples for the cross-fade
    tokens_fed: int = 0
    samples_out: int = 0
    played_until: Optional[float] = None               # when a listener's audio so far runs out (FeedBatch's clock)


def load_flow_checkpoint(model_dir: Union[str, Path]) -> CausalMaskedDiffWithXvec:
    """The flow of a token2wav folder: built from flow.yaml, flow.pt loaded strictly, float32 on the CPU."""
    flow = load_flow(Path(model_dir) / "flow.yaml")
    state = torch.load(Path(model_dir) / "flow.pt", map_location="cpu", weights_only=True)
    flow.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return flow


class Token2WavEngine:
    sample_rate: int = SAMPLE_RATE

    def __init__(self, flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator, device: Union[str, torch.device] = "cpu",
                 dtype: Union[str, torch.dtype] = "float32", n_timesteps: int = N_TIMESTEPS, cuda_graphs: bool = False,
                 graph_mib: int = 16384, encoder_graph_mib: int = 8192, chunk_quantum: int = CHUNK_QUANTUM_TOKENS,
                 max_chunk_tokens: int = MAX_CHUNK_TOKENS, max_batch_rows: int = 16, compile_fused: bool = False,
                 calm_batch_rows: int = 4, calm_slack_s: float = 1.0):
        if not 1 <= chunk_quantum <= max_chunk_tokens:
            raise ValueError(f"need 1 <= chunk_quantum ({chunk_quantum}) <= max_chunk_tokens ({max_chunk_tokens})")
        self.chunk_quantum = chunk_quantum
        self.max_chunk_tokens = max_chunk_tokens
        self.max_batch_rows = max_batch_rows   # streams per engine call at most (FeedBatch.step)
        # Streams per call while the most urgent of them still has calm_slack_s of audio to play (FeedBatch.step).
        self.calm_batch_rows = calm_batch_rows
        self.calm_slack_s = calm_slack_s
        # Whether FeedBatch shrinks a call that would make listeners of other chunk sizes late (scheduling).
        self.deadline_lookahead = True
        self.on_call: Optional[Callable[[CallRecord], None]] = None   # called after every FeedBatch call
        self.call_costs = CallCosts()   # how long calls of each size took: FeedBatch's look-ahead
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.flow = flow.to(device=self.device, dtype=self.dtype).eval()
        # HiFT keeps its F0 predictor and source path in fp32 (rounding F0 detunes the harmonics):
        # set_compute_dtype casts only the rest.
        self.hift = hift.to(device=self.device).set_compute_dtype(self.dtype).eval()
        self.n_timesteps = n_timesteps
        # Per-step timestep modulations and stacked q/k/v weights, computed once instead of in every solve.
        self.flow.decoder.freeze(n_timesteps)
        self.mel_channels = self.flow.output_size
        self.lookahead = self.flow.pre_lookahead_len
        # Every last chunk plan_chunks makes fits this (a remainder under the quantum, plus the lookahead).
        self.last_chunk_frames = (chunk_quantum + self.lookahead) * self.flow.up_rate
        self.samples_per_frame = int(getattr(hift, "samples_per_frame", 480))
        self.samples_per_token = self.samples_per_frame * self.flow.up_rate
        self.hift_cache_samples = HIFT_CACHE_FRAMES * self.samples_per_frame
        # Hamming window of twice the overlap, as upstream; float64 like upstream's numpy window. On the
        # engine's device: copied from the host in every call, it was a blocking copy that waited for
        # the whole call's GPU work, once per stream of the call, before the rest could be queued.
        self.fade_window = torch.hamming_window(2 * self.hift_cache_samples, periodic=False, dtype=torch.float64,
                                                device=self.device)
        # The estimator solve and HiFT's decoder are launch-bound on a GPU: replay them from CUDA graphs.
        # The solve returns only each chunk's own attention-cache frames (new_only): the engine prepends
        # them to each stream's old cache, and a CUDA graph's static output stays chunk-sized.
        self.solve = functools.partial(self.flow.decoder.forward_chunk, new_only=True)
        self.encode = self._encode
        self.graphed_solve: Optional[GraphedCall] = None
        # The DiT's elementwise groups as generated fused kernels (backends.token2wav.fused); compiled on
        # the first solves, i.e. during the warm-up. A process-wide switch, and CUDA tensors only.
        if compile_fused and self.device.type == "cuda":
            fused.use_compiled(True)
        if cuda_graphs and self.device.type == "cuda":
            self.graphed_solve = GraphedCall(self.solve, max_bytes=graph_mib << 20)
            self.solve = self.graphed_solve
            # Measured on an H100: a 2 GiB budget stopped at 46 of the ~113 shapes the warm-up captures (the
            # shared pool grows most at the first captures), and the rest ran eagerly in every call; all
            # 113 hold 2.2-3.9 GiB (varies run to run). The default leaves room for voices of other prompt lengths.
            self.encode = GraphedCall(self._encode, max_bytes=encoder_graph_mib << 20)
            # batch 1..16 (powers of two) x the canonical chunk sizes, and 1-2 rows x every last-chunk length
            self.hift.enable_cuda_graphs(max_shapes=128)

    # ---- loading ----

    @classmethod
    def load(cls, model_dir: Union[str, Path], device: str = "cpu", dtype: str = "float32",
             cuda_graphs: bool = False, graph_mib: int = 16384, encoder_graph_mib: int = 8192,
             compile_fused: bool = False) -> "Token2WavEngine":
        """Read flow.yaml, flow.pt and hift.pt from a Step-Audio2 token2wav folder; strict state-dict loads."""
        model_dir = Path(model_dir)
        for name in ("flow.yaml", "flow.pt", "hift.pt"):
            if not (model_dir / name).is_file():
                raise FileNotFoundError(f"{model_dir / name} is missing (need flow.yaml, flow.pt, hift.pt)")
        flow = load_flow_checkpoint(model_dir)
        hift = load_hift(model_dir / "hift.pt", device="cpu", dtype=torch.float32,
                         **hift_hyperparams_from_checkpoint(model_dir / "hift.pt"))
        return cls(flow, hift, device=device, dtype=dtype, cuda_graphs=cuda_graphs, graph_mib=graph_mib,
                   encoder_graph_mib=encoder_graph_mib, compile_fused=compile_fused)

    # ---- voices ----

    @torch.inference_mode()
    def prepare_voice(self, prompt_tokens: TokensLike, prompt_mel: Any, speaker_embedding: Any,
                      lookahead_pad: str = "silence") -> VoiceConditioning:
        """Precompute a voice: prompt tokens [T] (0..6560), prompt mel [2T, 80], speaker embedding [192].

        lookahead_pad: "silence" pads the prompt with 3 x token 4218 (Step-Audio2 package), "repeat"
        with its first 3 tokens (the seed's Triton path). The mel may differ from 2T frames by at most
        4 (trimmed, or padded by repeating its last frame, as upstream's frontend does).
        """
        tokens = validate_tokens(prompt_tokens, "prompt_tokens")
        if not tokens:
            raise ValueError("prompt_tokens is empty: a voice needs at least one prompt token")
        mel = _float_array(prompt_mel, "prompt_mel")
        if mel.ndim == 3 and mel.shape[0] == 1:
            mel = mel[0]
        if mel.ndim != 2 or mel.shape[1] != self.mel_channels:
            raise ValueError(f"prompt_mel must have shape [frames, {self.mel_channels}], got {tuple(mel.shape)}")
        want = len(tokens) * self.flow.up_rate
        if abs(mel.shape[0] - want) > 4:
            raise ValueError(f"prompt_mel has {mel.shape[0]} frames but {len(tokens)} prompt tokens need {want}")
        mel = mel[:want] if mel.shape[0] >= want else torch.cat([mel, mel[-1:].expand(want - mel.shape[0], -1)])
        spk = _float_array(speaker_embedding, "speaker_embedding").reshape(1, -1)
        expected_spk = self.flow.spk_embed_affine_layer.in_features
        if spk.shape[1] != expected_spk:
            raise ValueError(f"speaker_embedding must have {expected_spk} values, got {spk.shape[1]}")
        if lookahead_pad == "silence":
            pad = [SILENCE_TOKEN] * self.lookahead
        elif lookahead_pad == "repeat":
            pad = [tokens[i % len(tokens)] for i in range(self.lookahead)]
        else:
            raise ValueError(f"lookahead_pad must be 'silence' or 'repeat', got {lookahead_pad!r}")

        prompt = torch.tensor([tokens], dtype=torch.long, device=self.device)
        mel_dev = mel.unsqueeze(0).to(self.device, self.dtype)
        spk_dev = spk.to(self.device, self.dtype)
        prompt_noise = FrameNoise(VOICE_NOISE_SEED, self.mel_channels).take(want)
        cache = self.flow.setup_cache(
            torch.cat([prompt, torch.tensor([pad], dtype=torch.long, device=self.device)], dim=1),
            mel_dev, spk_dev, self._fixed_noise(prompt_noise), self.n_timesteps,
        )
        ring = DiTCacheRing.from_prompt(cache.estimator_att, self.cache_width(want), CACHE_RECENT_FRAMES)
        caches = StreamCaches(cache.conformer_cnn, cache.conformer_att, cache.estimator_cnn, ring)
        return VoiceConditioning(prompt, mel_dev, spk_dev, self.flow.project_speaker(spk_dev), prompt_noise,
                                 caches, lookahead_pad)

    # ---- streaming ----

    def start_stream(self, voice: VoiceConditioning, seed: int = 0) -> StreamState:
        return StreamState(
            voice=voice,
            seed=int(seed),
            flow_noise=FrameNoise(seed, self.mel_channels),
            # a different stream of numbers than the flow noise, still a function of the seed only
            # on the engine's device: drawing NSF noise on the host and copying costs ms per chunk on a GPU
            hift_generator=torch.Generator(device=self.device).manual_seed(int(seed) ^ 0x48494654),
            # The conformer and conv caches are replaced after each chunk: shared with the voice until
            # then. The DiT ring is written in place: the stream's own copy from the start.
            flow_cache=dataclasses.replace(voice.prompt_cache, estimator_att=voice.prompt_cache.estimator_att.copy()),
        )

    @torch.inference_mode()
    def feed(self, state: StreamState, tokens: TokensLike, final: bool) -> np.ndarray:
        """Append tokens; return the PCM (float32, 24 kHz, mono) that became ready, possibly empty."""
        result = self.feed_many([(state, tokens, final)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def plan_chunks(self, started: bool, pending: int, final: bool) -> list[tuple[int, bool]]:
        """How a call turns ``pending`` buffered tokens into flow chunks: (tokens consumed, last_chunk)
        in order; a non-last chunk also reads the ``lookahead`` tokens after the ones it consumes.

        Why: a CUDA graph serves one shape. A stream that falls behind its LLM sends every token that
        waited (any count); synthesised as one chunk, each such count was a new shape that ran eagerly
        at ~10x the cost, exactly when the server was busiest. So the first chunk is FIRST_CHUNK_TOKENS
        (the rest waits for the next call: first audio as early as possible), later chunks are whole
        multiples of ``chunk_quantum`` of at most ``max_chunk_tokens``, and a remainder shorter than the
        quantum waits for the next call, unless it is all the call has (a client feeding small pieces
        gets each back at once). A final call flushes everything: whole chunks, then the remainder and
        the lookahead tokens as the last chunk.
        """
        ready, chunks = pending - self.lookahead, []
        if not started:
            if ready < FIRST_CHUNK_TOKENS:
                return [(pending, True)] if final and pending else []
            chunks.append((FIRST_CHUNK_TOKENS, False))
            ready -= FIRST_CHUNK_TOKENS
            if not final:
                return chunks
        while ready >= self.max_chunk_tokens:
            chunks.append((self.max_chunk_tokens, False))
            ready -= self.max_chunk_tokens
        whole = max(ready, 0) // self.chunk_quantum * self.chunk_quantum
        if whole:
            chunks.append((whole, False))
            ready -= whole
        elif not chunks and ready > 0 and not final:
            chunks.append((ready, False))
            ready = 0
        if final:
            chunks.append((ready + self.lookahead, True))
        return chunks

    @torch.inference_mode()
    def feed_many(self, items: Sequence[tuple[StreamState, TokensLike, bool]],
                  on_result: Optional[Callable[[int, Union[np.ndarray, Exception]], None]] = None,
                  ) -> list[Union[np.ndarray, Exception]]:
        """``feed`` for several streams at once: their chunks run as batched flow and HiFT calls.

        Each item is (state, tokens, final); the result list holds, per item, its PCM or the exception
        its feed raised (that stream is unusable afterwards, as after a failed ``feed``). The output of
        each stream is what ``feed`` would give, up to floating-point rounding of the batched matrix
        products. ``on_result(index, result)`` is called as soon as an item's result is known, before
        the rest is done (see ``FeedBatch`` for the order).
        """
        results: list[Union[np.ndarray, Exception, None]] = [None] * len(items)

        def record(index: Hashable, result: Union[np.ndarray, Exception]) -> None:
            results[index] = result  # type: ignore[index]
            if on_result is not None:
                on_result(index, result)  # type: ignore[arg-type]

        # No calm calls: the feeds are all here at once, and the warm-up needs its batches at full size
        # (with calm calls its 8- and 16-stream rounds ran as 4-stream calls, so those shapes first
        # met a CUDA graph on a request's time: 0.5-1 s calls at 64 streams).
        batch = self.feed_batch(record, calm_calls=False)
        for index, (state, tokens, final) in enumerate(items):
            batch.add(index, state, tokens, final)
        while batch.step():
            pass
        return results  # type: ignore[return-value]

    def feed_batch(self, on_result: Callable[[Hashable, Union[np.ndarray, Exception]], None],
                   clock: Callable[[], float] = time.monotonic, *, calm_calls: bool = True) -> "FeedBatch":
        """An open batch: feeds added at any time, run one batched engine call per ``step`` (a server's
        worker thread adds the requests that arrived between two steps). ``clock`` times the listeners'
        playback, which decides the order of the calls; ``calm_calls=False``: every call as large as
        the feeds allow (see ``FeedBatch``)."""
        return FeedBatch(self, on_result, clock, calm_calls=calm_calls)

    @torch.inference_mode()
    def warm_up(self, voice: VoiceConditioning, max_rows: int = 16) -> int:
        """Capture the CUDA graphs of every canonical chunk shape before serving; returns feed_many calls.

        Why: a shape is captured on its second sighting and a capture costs about twice an eager call
        (~0.6 s at 16 streams on an H100), so without this the first busy minutes of a server pay them
        in its users' latency. Runs batches of 1, 2, 4 ... ``max_rows`` streams of ``voice`` through the
        first chunk, every whole chunk size (25, 50, 75, 100 tokens) and a padded last chunk, twice.
        The solve graphs serve every voice whose cache width (``cache_width``) equals this voice's.
        No-op without CUDA graphs.
        """
        if self.graphed_solve is None:
            return 0
        tokens = [(7 * i) % NUM_SPEECH_TOKENS for i in range(FIRST_CHUNK_TOKENS + self.lookahead + self.max_chunk_tokens)]
        # One stream first: the fused kernels (``fused``) compile for the first shapes they see and run
        # every later shape from a slower symbolic-shape build, and one stream's first chunk is the
        # latency that matters most. Then the largest shapes first: the graphs share one memory pool,
        # and a capture reuses what the larger ones before it freed (smallest first, each larger capture
        # grew the pool: 29 solve graphs held 25 GiB on an H100). The solve's shapes do not depend on
        # the chunks before, so the whole sizes can run in any order after the first chunk.
        sizes = [FIRST_CHUNK_TOKENS + self.lookahead] + list(range(self.max_chunk_tokens, 0, -self.chunk_quantum))
        calls = 0
        for rows in [1] + powers_of_two_down(max_rows)[:-1]:
            for _ in range(2):
                states = [self.start_stream(voice, seed=k) for k in range(rows)]
                for size in sizes:
                    self.feed_many([(state, tokens[:size], False) for state in states])
                self.feed_many([(state, tokens[:self.chunk_quantum - 1], True) for state in states])
                calls += len(sizes) + 1
        self._warm_up_encoder_and_hift(voice, max_rows)
        return calls

    def encoder_cache_lengths(self, prompt_frames: int) -> list[int]:
        """Conformer cache lengths a stream of this voice reaches before a non-first chunk: after 15
        tokens, then every 25 more (chunks are multiples of 25), until truncation holds it at
        prompt + CACHE_RECENT_FRAMES."""
        limit, consumed, lengths = prompt_frames + CACHE_RECENT_FRAMES, FIRST_CHUNK_TOKENS, []
        while prompt_frames + consumed * self.flow.up_rate < limit:
            lengths.append(prompt_frames + consumed * self.flow.up_rate)
            consumed += self.chunk_quantum
        return lengths + [limit]

    def _warm_up_encoder_and_hift(self, voice: VoiceConditioning, max_rows: int) -> None:
        """Capture what the schedule of ``warm_up`` does not reach, calling the graphed parts directly:

        - the encoder at every (conformer cache length, whole chunk size) a stream can meet: a stream
          whose LLM ran ahead sends 50 or 100 tokens where ``warm_up``'s streams send 25;
        - a last chunk of every length (1 to 24 tokens + the lookahead) at 1 and 2 rows
          (LAST_CHUNK_GRAPH_ROWS), encoder and HiFT, with the cache a long stream has: a last chunk
          never captures on a request's time (``_flow_chunks``), and runs in groups of that size
          (``_graph_groups``).
        """
        cnn, att = voice.prompt_cache.conformer_cnn, voice.prompt_cache.conformer_att
        width = self.flow.input_embedding.embedding_dim

        def encode_twice(rows: int, tokens: int, cache_length: int, last: bool) -> None:
            att_shape = list(att.shape)
            att_shape[1], att_shape[3] = rows, cache_length
            args = (att.new_zeros(rows, tokens, width), cnn.new_zeros(rows, *cnn.shape[1:]),
                    att.new_zeros(att_shape), last)
            for _ in range(2):  # captured at the second sighting
                self.encode(*args)

        lengths = self.encoder_cache_lengths(voice.prompt_frames)
        for rows in powers_of_two_down(max_rows):  # largest first: one memory pool (see warm_up)
            for cache_length in reversed(lengths):
                for size in range(self.max_chunk_tokens, 0, -self.chunk_quantum):
                    encode_twice(rows, size + self.lookahead, cache_length, False)
        for rows in powers_of_two_down(LAST_CHUNK_GRAPH_ROWS):
            for tokens in range(self.chunk_quantum + self.lookahead - 1, self.lookahead, -1):
                encode_twice(rows, tokens, lengths[-1], True)
                frames = HIFT_CACHE_FRAMES + tokens * self.flow.up_rate
                mel = torch.zeros(rows, self.mel_channels, frames, device=self.device, dtype=self.dtype)
                source = torch.zeros(rows, 1, self.hift_cache_samples, device=self.device)
                for _ in range(2):
                    self.hift.inference(mel, source, generator=torch.Generator(device=self.device).manual_seed(0))

    def graph_counts(self) -> dict[str, tuple[int, int, int]]:
        """(CUDA graphs held, eager runs so far, graph bytes) of each graphed part: the solve, the encoder
        and HiFT (empty without CUDA graphs). An eager run is a shape no graph had."""
        parts = {"solve": self.graphed_solve, "encoder": self.encode, "hift": self.hift._graphed_decode}
        return {name: (part.num_graphs, part.eager_runs, part.graph_bytes)
                for name, part in parts.items() if hasattr(part, "eager_runs")}

    def graph_summary(self) -> str:
        """One line: graphs, eager runs and graph memory per part (logged after the warm-up)."""
        return "; ".join(f"{name} {graphs} graphs {nbytes / 2**30:.2f} GiB, {eager} eager runs"
                         for name, (graphs, eager, nbytes) in self.graph_counts().items()) or "no CUDA graphs"

    def state_nbytes(self, state: StreamState) -> int:
        """Approximate bytes held by this stream alone (the shared voice is not counted)."""
        held = 0
        if state.flow_cache is not None:
            shared = state.voice.prompt_cache.tensors()
            held += sum(t.numel() * t.element_size() for t, voices in zip(state.flow_cache.tensors(), shared)
                        if t is not voices)
        for tensor in (state.hift_mel, state.hift_source, state.hift_speech, state.flow_noise.buffer):
            if tensor is not None:
                held += tensor.numel() * tensor.element_size()
        return held + 8 * len(state.pending) + 1024

    # ---- offline ----

    @torch.inference_mode()
    def synthesize(self, voice: VoiceConditioning, tokens: TokensLike, seed: int = 0) -> np.ndarray:
        """Whole utterance at once (full attention); len(tokens) * 960 samples."""
        ids = validate_tokens(tokens)
        if not ids:
            return np.zeros(0, dtype=np.float32)
        token_tensor = torch.tensor([ids], dtype=torch.long, device=self.device)
        noise = torch.cat([voice.prompt_noise, FrameNoise(seed, self.mel_channels).take(len(ids) * self.flow.up_rate)], 2)
        mel = self.flow.inference(token_tensor, voice.prompt_tokens, voice.prompt_mel, voice.speaker_embedding,
                                  self._fixed_noise(noise), self.n_timesteps)
        generator = torch.Generator().manual_seed(int(seed) ^ 0x48494654)
        wav, _ = self.hift.inference(mel, None, generator=generator)
        return wav[0].float().cpu().numpy()

    # ---- internals ----

    def _fixed_noise(self, noise: torch.Tensor):
        """Noise callable over a precomputed (1, 80, n) tensor: frames [offset, offset+n) ."""
        def take(offset: int, n_frames: int) -> torch.Tensor:
            if offset + n_frames > noise.shape[2]:
                raise RuntimeError(f"noise for frames {offset}..{offset + n_frames} requested, {noise.shape[2]} prepared")
            return noise[:, :, offset:offset + n_frames].to(self.device, self.dtype)
        return take

    def _flow_chunk(self, state: StreamState, tokens: list[int], last_chunk: bool) -> torch.Tensor:
        return self._flow_chunks([state], [tokens], last_chunk)[0]

    def _flow_chunks(self, states: list[StreamState], tokens: list[list[int]], last_chunk: bool) -> list[torch.Tensor]:
        """One flow chunk for each stream; the estimator solve runs as one batch.

        Non-last chunks must have equal token counts; last chunks may differ (each is padded to the
        longest, with CUDA graphs to ``last_chunk_frames``: nothing after a last chunk reads its caches,
        so only its attention keys need masking). The conformer encoder runs once per group of streams
        with equal token counts and cache shapes (its relative-position attention needs them equal; it
        is the cheap part). The estimator caches (rings of ``cache_width``: the longest a cache of the voice
        can get, prompt frames + CACHE_RECENT_FRAMES, rounded up to CACHE_WIDTH_STEP) are padded to the
        widest and masked, so streams at different points of the schedule, or with voices of different
        prompt lengths, share the solve. With CUDA graphs the batch is padded to a power of two with zero
        rows (their output is dropped): a few graphs serve every mix of streams.

        Batch layout of the estimator caches: the CFG halves as [cond of every row, uncond of every row]
        on axis 2, the layout the solver uses. Each stream then gets its own copy of its rows (never a
        view of the batch, nor of a CUDA graph's static output): the conformer's cut as upstream cuts it,
        the DiT's new frames written into its ring.
        """
        flow, batch = self.flow, len(states)
        if not last_chunk and len({len(t) for t in tokens}) > 1:
            raise ValueError("non-last chunks of one batch must have equal token counts")
        mus: list[torch.Tensor] = [torch.empty(0)] * batch
        conformer: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.empty(0), torch.empty(0))] * batch
        by_shape: dict[tuple, list[int]] = {}
        for i, state in enumerate(states):
            cache = state.flow_cache
            key = (len(tokens[i]), tuple(cache.conformer_cnn.shape), tuple(cache.conformer_att.shape))
            by_shape.setdefault(key, []).append(i)
        for members in self._graph_groups(by_shape.values(), last_chunk):
            caches = [states[i].flow_cache for i in members]
            token_tensor = _to_device(torch.tensor([tokens[i] for i in members], dtype=torch.long), self.device)
            embedded = flow.input_embedding(token_tensor)
            cnn_cache = _stack([c.conformer_cnn for c in caches], 0)
            att_cache = _stack([c.conformer_att for c in caches], 1)
            if self.graphed_solve is not None:
                # Groups come in every size (streams at one point of the schedule): padded to a power of
                # two with zero rows, a few graphs serve them all (an odd size ran eagerly or paid a capture).
                group_rows = graph_rows(len(members))
                embedded, cnn_cache = _pad_rows(embedded, 0, group_rows), _pad_rows(cnn_cache, 0, group_rows)
                att_cache = _pad_rows(att_cache, 1, group_rows)
            # A last chunk has any length: its graphs come from the warm-up only, never from a capture on
            # a request's time (measured: 0.5-1 s calls at 64 streams while last-chunk shapes were captured).
            encode = getattr(self.encode, "replay_only", self.encode) if last_chunk else self.encode
            mu, cnn, att = encode(embedded, cnn_cache, att_cache, last_chunk)
            # Copied out now: with CUDA graphs these are static buffers that the next encode overwrites.
            for row, i in enumerate(members):
                mus[i] = mu[row:row + 1].clone()
                if not last_chunk:  # a last chunk's caches are dropped with its stream
                    conformer[i] = (cnn[row:row + 1].clone(), att[:, row:row + 1].clone())
        lengths = [int(m.shape[2]) for m in mus]
        frames = max(lengths)
        if last_chunk and self.graphed_solve is not None and frames <= self.last_chunk_frames:
            frames = self.last_chunk_frames
        noises = [s.flow_noise.take(n) for s, n in zip(states, lengths)]
        mu = torch.cat([F.pad(m, (0, frames - m.shape[2])) for m in mus])
        noise = _to_device(torch.cat([F.pad(z, (0, frames - z.shape[2])) for z in noises]), self.device).to(self.dtype)
        spks = _stack([s.voice.projected_speaker for s in states], 0)
        rows = batch if self.graphed_solve is None else graph_rows(batch)
        mu, noise, spks = (_pad_rows(t, 0, rows) for t in (mu, noise, spks))
        cnn_cache, att_cache, key_mask = self._estimator_batch(states, rows, lengths, frames)
        mel, estimator_cnn, estimator_att = self.solve(
            mu, spks, torch.zeros_like(mu), noise, self.n_timesteps, cnn_cache, att_cache, key_mask)
        mels = []
        for i, state in enumerate(states):
            mels.append(mel[i:i + 1, :, :lengths[i]].clone())
            if last_chunk:  # the stream ends: its caches are released, not updated
                continue
            ring = state.flow_cache.estimator_att
            ring.add(_cfg_rows(estimator_att, i, rows).movedim(2, 0)[..., :lengths[i], :])
            state.flow_cache = StreamCaches(
                conformer[i][0],
                keep_prompt_and_recent(conformer[i][1], 3, state.voice.prompt_frames, CACHE_RECENT_FRAMES),
                _cfg_rows(estimator_cnn, i, rows).clone(memory_format=torch.contiguous_format),
                ring,
            )
        return mels

    def _graph_groups(self, groups: Iterable[list[int]], last_chunk: bool) -> Iterator[list[int]]:
        """Groups of streams as the encoder or HiFT runs them. With CUDA graphs, a last-chunk group is
        split into groups of at most LAST_CHUNK_GRAPH_ROWS, the batch the warm-up captures last chunks
        at: last chunks only replay graphs, and a larger group ran eagerly (50-150 ms per part where a
        replay takes a few; calls of 16 streams' last chunks took 150-570 ms at 64 streams)."""
        limit = LAST_CHUNK_GRAPH_ROWS if last_chunk and self.graphed_solve is not None else 0
        for members in groups:
            if not limit:
                yield members
                continue
            for at in range(0, len(members), limit):
                yield members[at:at + limit]

    def cache_width(self, prompt_frames: int) -> int:
        """Width of a voice's DiT cache ring (``DiTCacheRing``): what every chunk of it attends over."""
        longest = prompt_frames + CACHE_RECENT_FRAMES
        return -(-longest // CACHE_WIDTH_STEP) * CACHE_WIDTH_STEP

    def _estimator_batch(self, states: list[StreamState], rows: int, chunk_lengths: list[int],
                         frames: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The estimator caches of ``states`` as one batch of ``rows`` rows: (cnn, att, key mask).

        att (steps, depth, 2*rows, heads, width, 2*head_dim) is stored row-major (``SOLVE_ATT_ORDER``), so
        each stream's ring copies in as two contiguous blocks (its cond and uncond rows); the key mask
        (2*rows, frames + width) marks the real frames of each row's chunk and the entries its ring holds
        (None when all are real and no CUDA graph needs a fixed argument list).
        """
        caches = [s.flow_cache for s in states]
        rings = [c.estimator_att for c in caches]
        if self.graphed_solve is None and rows == 1:
            # One stream, eagerly: the solve reads the ring itself (it only reads the cache).
            att = rings[0].kv.movedim(0, 2)
            cnn = caches[0].estimator_cnn
        else:
            first_att, first_cnn = rings[0].kv, caches[0].estimator_cnn
            att_shape = (*first_att.shape[1:3], 2 * rows, first_att.shape[3], max(r.width for r in rings),
                         first_att.shape[5])
            cnn_shape = (*first_cnn.shape[:2], 2 * rows, *first_cnn.shape[3:])
            if self.graphed_solve is not None:
                # Filled in place in the graphs' own input buffers (no copy into them at replay). What this
                # call does not overwrite is an earlier call's cache: finite values the key mask hides.
                att = self.graphed_solve.input_buffer(SOLVE_ATT_ARG, att_shape, first_att.dtype, first_att.device,
                                                      memory_order=SOLVE_ATT_ORDER)
                cnn = self.graphed_solve.input_buffer(SOLVE_CNN_ARG, cnn_shape, first_cnn.dtype, first_cnn.device)
            else:
                att = zeros_in_memory_order(att_shape, SOLVE_ATT_ORDER, first_att.dtype, first_att.device)
                cnn = first_cnn.new_zeros(cnn_shape)
            for i, (cache, ring) in enumerate(zip(caches, rings)):
                # Both CFG halves of a stream (rows i and rows + i) in one copy each, through a view.
                _cfg_rows(att, i, rows).movedim(2, 0)[..., :ring.width, :].copy_(ring.kv)
                _cfg_rows(cnn, i, rows).copy_(cache.estimator_cnn)
        mask = torch.zeros(2 * rows, frames + att.shape[4], dtype=torch.bool)
        mask[:, :frames] = True   # filler rows: their own chunk only
        for i, (ring, chunk) in enumerate(zip(rings, chunk_lengths)):
            start, stop = ring.held_positions()
            for row in (i, rows + i):
                mask[row, chunk:frames] = False
                mask[row, frames + start:frames + stop] = True
        if self.graphed_solve is None and bool(mask.all()):
            return cnn, att, None
        return cnn, att, _to_device(mask, self.device)

    def _encode(self, embedded: torch.Tensor, cnn_cache: torch.Tensor, att_cache: torch.Tensor,
                last_chunk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conformer encoder + projection of one (batched) chunk: mu (b, 80, frames) and the new caches."""
        h, cnn, att = self.flow.encoder.forward_chunk(embedded, last_chunk, cnn_cache, att_cache)
        return self.flow.encoder_proj(h).transpose(1, 2).contiguous(), cnn, att

    def _vocode_many(self, states: list[StreamState], chunk_mels: list[torch.Tensor], final: bool) -> list[torch.Tensor]:
        """``_vocode`` for several streams: one batched HiFT call per group of streams whose mel and
        excitation caches have equal shapes (streams at the same point of the schedule).

        Why: HiFT at batch 1 costs a few ms per stream even from a CUDA graph, so vocoding the streams
        of a batched flow call one by one made every extra stream in the batch add that much latency.
        Each stream keeps its own NSF noise (one generator per row), so its samples do not depend on
        which streams it was batched with.
        """
        mels = [m if s.hift_mel is None else torch.cat([s.hift_mel, m], dim=2) for s, m in zip(states, chunk_mels)]
        groups: dict[tuple, list[int]] = {}
        for i, (state, mel) in enumerate(zip(states, mels)):
            source_shape = None if state.hift_source is None else tuple(state.hift_source.shape)
            groups.setdefault((tuple(mel.shape), source_shape), []).append(i)
        pcms: list[torch.Tensor] = [torch.empty(0)] * len(states)
        for members in self._graph_groups(groups.values(), final):
            for i, pcm in zip(members, self._vocode_batch([states[i] for i in members], [mels[i] for i in members], final)):
                pcms[i] = pcm
        return pcms

    def _vocode_batch(self, states: list[StreamState], mels: list[torch.Tensor], final: bool) -> list[torch.Tensor]:
        """One HiFT call for streams whose (cache + chunk) mels and excitation caches have equal shapes."""
        sources = [s.hift_source for s in states]
        cache = None if sources[0] is None else _stack(sources, 0)
        generators = [s.hift_generator for s in states]
        speech, source = self.hift.inference(_stack(mels, 0), cache,
                                             generator=generators if len(generators) > 1 else generators[0],
                                             capture=not final)   # last chunks: see _flow_chunks
        speech = speech.float()
        pcms = []
        for row, state in enumerate(states):
            own = speech[row:row + 1]
            if state.hift_speech is not None and state.hift_speech.shape[-1] > 0:
                own = self._cross_fade(own, state.hift_speech)
            state.hift_mel = mels[row][..., -HIFT_CACHE_FRAMES:].clone()
            state.hift_source = source[row:row + 1, :, -self.hift_cache_samples:].clone()
            state.hift_speech = own[..., -self.hift_cache_samples:].clone()
            pcms.append(own[0] if final else own[0, : -self.hift_cache_samples])
        return pcms

    def _cross_fade(self, speech: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Blend the first `overlap` samples with the previous call's held-back tail (upstream's fade_in_out)."""
        overlap = self.hift_cache_samples
        window = self.fade_window
        faded = speech.clone()
        head = speech[..., :overlap].double() * window[:overlap] + previous[..., -overlap:].double() * window[overlap:]
        faded[..., :overlap] = head.to(speech.dtype)
        return faded

    def _emit_many(self, states: list[StreamState], pcms: list[torch.Tensor]) -> list[np.ndarray]:
        """PCM tensors -> float32 arrays with one device-to-host copy (one sync) for the whole batch."""
        lengths = [int(p.shape[0]) for p in pcms]
        flat = torch.cat([p.float().reshape(-1) for p in pcms]).cpu().numpy()
        outs = np.split(flat, np.cumsum(lengths)[:-1]) if len(pcms) > 1 else [flat]
        for state, out in zip(states, outs):
            state.samples_out += int(out.shape[0])
        return outs

    @staticmethod
    def _release(state: StreamState) -> None:
        state.flow_cache = None
        state.pending = []
        state.hift_mel = state.hift_source = state.hift_speech = None


@dataclass(frozen=True)
class CallRecord:
    """One engine call of a FeedBatch, for ``Token2WavEngine.on_call`` (the server's call trace).

    Times are the batch's clock, in seconds. ``slack_s``: the earliest member deadline minus the call's
    start (``_deadline``): audio a listener still had, negative once stalled, or for a first chunk its
    100 ms allowance left; -inf for a stream mid-feed with no audio out yet. ``waited_s``: the longest
    a member's feed had waited since it was added. ``seconds`` ends at the call's last host copy, so it
    is GPU time only when some feed ``settled`` (returned its audio) in this call."""

    started: float
    rows: int
    tokens: int
    last: bool
    first: bool
    queued: int
    slack_s: float
    waited_s: float
    seconds: float = 0.0
    settled: int = 0
    reply_s: float = 0.0
    """Of ``seconds``, the time spent in ``on_result`` (under the server: handing the answers to the
    service's answer thread)."""
    captured: int = 0
    """CUDA graphs captured during the call."""
    eager: int = 0
    """Graphed parts (solve, encoder groups, HiFT groups) that ran eagerly: shapes without a graph."""
    parts: str = ""
    """Which parts captured (c) or ran eagerly (e), e.g. ``encoder:c0e2``."""
    held: int = 0
    """Feeds of the call's size left for a later call so that listeners of other sizes stay in time
    (``scheduling.rows_keeping_deadlines``)."""

    def line(self) -> str:
        kind = "first" if self.first else "last" if self.last else f"{self.tokens}"
        return (f"call t={self.started:.3f} {kind} rows={self.rows} queued={self.queued} "
                f"ms={1000 * self.seconds:.1f} reply_ms={1000 * self.reply_s:.1f} settled={self.settled} "
                f"slack_ms={1000 * self.slack_s:.0f} waited_ms={1000 * self.waited_s:.0f} "
                f"captured={self.captured} eager={self.eager} held={self.held} {self.parts}").rstrip()


@dataclass
class _Feed:
    """One feed in a FeedBatch: its stream, the chunks still to run, the PCM of those that ran."""

    state: StreamState
    plan: list[tuple[int, bool]]
    pieces: list[torch.Tensor] = field(default_factory=list)
    added_at: float = 0.0

    @property
    def batch_key(self) -> tuple[int, bool]:
        """Feeds whose next chunks share this key run together (last chunks are padded to one size)."""
        return _chunk_key(*self.plan[0])

    def due(self, deadline: float) -> Due:
        """The feed as the look-ahead sees it (``scheduling.Due``)."""
        return Due(deadline, self.batch_key, listening=self.state.played_until is not None,
                   then=tuple(_chunk_key(*chunk) for chunk in self.plan[1:]))


def _chunk_key(consumed: int, last: bool) -> tuple[int, bool]:
    return (0, True) if last else (consumed, False)


class FeedBatch:
    """Feeds of several streams in progress. ``add`` plans a feed's chunks (``plan_chunks``); each
    ``step`` runs one batch: the next chunk of every stream whose next chunk has the chosen size (all
    last chunks count as one size: they are padded to one). ``on_result(key, pcm or exception)`` is
    called once per added feed, as soon as its last chunk is done.

    Which batch runs next: earliest deadline first, the chunk size of the most urgent feed.
    - A playing stream's deadline is when a listener who started at its first audio, in real time,
      runs out of the audio it got (``StreamState.played_until``, the bench's playback model). A
      stream with seconds of audio buffered waits for one about to stall, instead of arrival order.
    - A new stream's first chunk is due ``FIRST_CHUNK_SLACK_S`` after it arrived: first chunks go
      ahead of every listener with more audio left than that (first audio is what a user waits for,
      and a first chunk is short), but not ahead of one about to stall (measured at 64 streams:
      first chunks always first left second chunks queued past their 0.44 s of first audio).
    - How many streams: up to ``max_batch_rows``; but while even the most urgent of the chosen streams
      has ``calm_slack_s`` of audio left and no backlog waits (all the feeds in progress would fit one
      full call), at most ``calm_batch_rows``. A first chunk that arrives meanwhile waits for the call
      in flight, and a call of 16 streams' 100-token chunks takes ~140 ms on an H100, one of 4 streams
      ~45 ms. Calls grow again as soon as anyone's audio runs short or work piles up (measured at 64
      streams: small calls with 50 feeds waiting let the queue grow to seconds).
    - And fewer, if a call that size would make a listener waiting on another chunk size late: the
      next calls are played forward with the call costs measured so far (``scheduling``), over the
      listeners due within ``calm_slack_s``.
    ``calm_calls=False`` (``feed_many``, the warm-up): every call as large as the feeds allow.
    """

    def __init__(self, engine: Token2WavEngine,
                 on_result: Callable[[Hashable, Union[np.ndarray, Exception]], None],
                 clock: Callable[[], float] = time.monotonic, *, calm_calls: bool = True) -> None:
        self._engine = engine
        self._calm_calls = calm_calls
        self._on_result = on_result
        self._clock = clock
        # Feeds with chunks to run, in arrival order (dicts keep insertion order); a feed leaves when settled.
        self._feeds: dict[Hashable, _Feed] = {}

    @property
    def pending(self) -> bool:
        """Whether chunks are waiting to run."""
        return bool(self._feeds)

    @torch.inference_mode()
    def add(self, key: Hashable, state: StreamState, tokens: TokensLike, final: bool) -> None:
        """Plan one feed (``key`` must not be in progress); answers at once when it needs no chunk."""
        engine = self._engine
        if key in self._feeds or any(feed.state is state for feed in self._feeds.values()):
            self._on_result(key, RuntimeError(f"feed {key!r}, or another feed of its stream, is already in progress"))
            return
        try:
            ids = validate_tokens(tokens)
            if state.finished:
                raise RuntimeError("this stream was already finished (final=True); start a new stream")
            state.pending.extend(ids)
            state.tokens_fed += len(ids)
            state.finished = bool(final)
            if final and not state.pending:  # nothing left to synthesise: release the held-back tail
                tail = state.hift_speech[0] if state.hift_speech is not None else torch.zeros(0, device=engine.device)
                self._feeds[key] = _Feed(state, [], [tail], added_at=self._clock())
                engine._release(state)
                self._settle([key])
                return
            plan = engine.plan_chunks(state.started, len(state.pending), bool(final))
            if not plan:
                self._on_result(key, np.zeros(0, dtype=np.float32))
                return
            self._feeds[key] = _Feed(state, plan, added_at=self._clock())
        except Exception as exc:  # noqa: BLE001 - reported per feed
            self._settle([key], exc)

    @torch.inference_mode()
    def step(self) -> bool:
        """Run one batched call (see the class docstring for which); returns ``pending``."""
        if not self.pending:
            return False
        engine = self._engine
        deadlines = {key: _deadline(feed) for key, feed in self._feeds.items()}
        # sorted() is stable: equal deadlines keep arrival order
        urgent = sorted(self._feeds, key=deadlines.__getitem__)
        chosen = self._feeds[urgent[0]].batch_key
        members = [key for key in urgent if self._feeds[key].batch_key == chosen]
        now = self._clock()
        calm = (self._calm_calls and self._feeds[members[0]].state.started
                and deadlines[members[0]] - now >= engine.calm_slack_s and len(self._feeds) <= engine.max_batch_rows)
        # At most max_batch_rows: a call's memory grows with its rows (~0.26 GB of attention cache per
        # stream at the published size), and its graphs exist up to that size.
        rows = max(min(engine.calm_batch_rows, engine.max_batch_rows) if calm else engine.max_batch_rows, 1)
        offered = min(rows, len(members))
        if self._calm_calls and engine.deadline_lookahead:  # fewer rows if a full call would make others late
            queue = [self._feeds[key].due(deadlines[key]) for key in urgent]
            rows = rows_keeping_deadlines(now, queue, chosen, rows, engine.max_batch_rows, engine.call_costs,
                                          horizon=now + engine.calm_slack_s)
        members = members[:rows]
        feeds = [self._feeds[key] for key in members]
        states = [feed.state for feed in feeds]
        last = feeds[0].plan[0][1]
        started, counts = self._clock(), engine.graph_counts()
        tracing = engine.on_call is not None
        if tracing:  # what the trace needs from before the call
            record = CallRecord(started=started, rows=len(feeds), tokens=feeds[0].plan[0][0], last=last,
                                first=not states[0].started, queued=len(self._feeds),
                                slack_s=min(deadlines[key] for key in members) - started,
                                waited_s=max(started - f.added_at for f in feeds), held=offered - len(feeds))
        try:
            chunks = [feed.plan[0][0] for feed in feeds]
            mels = engine._flow_chunks(
                states, [s.pending[:n if last else n + engine.lookahead] for s, n in zip(states, chunks)],
                last_chunk=last)
            for state, consumed in zip(states, chunks):
                state.pending = state.pending[consumed:]
                state.started = True
            for feed, pcm in zip(feeds, engine._vocode_many(states, mels, final=last)):
                feed.pieces.append(pcm)
                feed.plan.pop(0)
            if last:
                for state in states:
                    engine._release(state)
            settled = [key for key, feed in zip(members, feeds) if not feed.plan]
            reply_s = self._settle(settled)
        except Exception as exc:  # noqa: BLE001 - the whole batch failed: every member's stream is unusable
            reply_s = self._settle([key for key in members if key in self._feeds], exc)
            settled = []
        seconds, after = self._clock() - started, engine.graph_counts()
        captured = {name: after[name][0] - counts[name][0] for name in counts}
        eager = {name: after[name][1] - counts[name][1] for name in counts}
        if settled and not any(captured.values()) and not any(eager.values()):
            # the steady cost of this size (a capture or an eager run is a one-off)
            engine.call_costs.observe(chosen, len(feeds), seconds - reply_s)
        if tracing:
            engine.on_call(dataclasses.replace(
                record, seconds=seconds, settled=len(settled), reply_s=reply_s,
                captured=sum(captured.values()), eager=sum(eager.values()),
                parts=" ".join(f"{name}:c{captured[name]}e{eager[name]}" for name in counts
                               if captured[name] or eager[name])))
        return self.pending

    def _settle(self, keys: list[Hashable], failure: Optional[Exception] = None) -> float:
        """Answer the feeds of ``keys`` (their audio, or ``failure``); returns the seconds ``on_result`` took."""
        if not keys:
            return 0.0
        if failure is None:
            feeds = [self._feeds[k] for k in keys]
            pcms = [f.pieces[0] if len(f.pieces) == 1 else torch.cat(f.pieces) for f in feeds]
            outputs: list = self._engine._emit_many([f.state for f in feeds], pcms)
            now = self._clock()
            for feed, output in zip(feeds, outputs):
                _played(feed.state, now, len(output) / self._engine.sample_rate)
        else:
            outputs = [failure] * len(keys)
        replying = self._clock()
        for key, output in zip(keys, outputs):
            self._feeds.pop(key, None)
            self._on_result(key, output)
        return self._clock() - replying



def _deadline(feed: _Feed) -> float:
    """When the feed's listener runs out of audio (``played_until``). A new stream's first chunk is
    due FIRST_CHUNK_SLACK_S after it arrived; a stream mid-feed with no audio out yet, at once."""
    state = feed.state
    if state.played_until is not None:
        return state.played_until
    return feed.added_at + FIRST_CHUNK_SLACK_S if not state.started else -math.inf


def _played(state: StreamState, now: float, seconds: float) -> None:
    """Advance a listener who plays in real time from the first audio, and after a stall resumes with
    the audio that ended it (``backends.bench.metrics.playback``), by ``seconds`` delivered at ``now``."""
    if seconds <= 0:
        return
    if state.played_until is None or now > state.played_until:
        state.played_until = now + seconds
    else:
        state.played_until += seconds


def _pad_rows(batch: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``batch`` with zero rows appended along ``dim`` up to ``rows``."""
    missing = rows - batch.shape[dim]
    if missing <= 0:
        return batch
    shape = list(batch.shape)
    shape[dim] = missing
    return torch.cat([batch, batch.new_zeros(shape)], dim=dim)


def _stack(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def _cfg_rows(batch: torch.Tensor, row: int, rows: int) -> torch.Tensor:
    """Row ``row``'s cond and uncond halves of an estimator cache batch laid out [cond..., uncond...] on
    axis 2 (``rows`` per half), in that stream's own cache layout (2 on axis 2): a view of ``batch``."""
    shape = batch.shape
    return batch.view(*shape[:2], 2, rows, *shape[3:]).select(3, row)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a stream sync.

    Why: a blocking host-to-device copy makes PyTorch wait for all queued GPU work first, and the GPU
    then idles while the host prepares what follows (the noise, the key mask and the tokens of every
    call did that, measured on an H100). A non-blocking copy from pageable memory is staged by the
    driver before it returns, so the host tensor may be freed or changed right after.
    """
    return tensor.to(device, non_blocking=True)


def hift_hyperparams_from_checkpoint(path: Union[str, Path]) -> dict[str, int]:
    """Channel widths of a hift.pt, read from its tensor shapes (the file carries no config).

    The published file has the reference defaults (512/512); test files are smaller.
    """
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) checkpoints cannot be memory-mapped
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    strip = {k.removeprefix("generator."): v for k, v in state.items()}
    params: dict[str, int] = {}
    if "conv_pre.bias" in strip:
        params["base_channels"] = int(strip["conv_pre.bias"].shape[0])
    if "f0_predictor.classifier.weight" in strip:
        params["f0_predictor_channels"] = int(strip["f0_predictor.classifier.weight"].shape[1])
    return params
