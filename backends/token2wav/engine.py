"""Streaming token2wav engine: speech tokens (25 Hz) -> 24 kHz float32 PCM, one explicit state per stream.

Call sequence (mirrors the Step-Audio2 ``token2wav.py`` wrapper, without its globals):

    engine = Token2WavEngine.load("token2wav/", device="cuda", dtype="float16")
    voice = engine.prepare_voice(prompt_tokens, prompt_mel, speaker_embedding)   # once per voice, cacheable
    state = engine.start_stream(voice, seed=7)                                    # once per utterance
    pcm = engine.feed(state, tokens, final=False)   # ... repeated; final=True flushes

Streaming rules:
- The flow needs ``pre_lookahead_len`` (3) future tokens for every token it turns into mel, so a
  non-final ``feed`` synthesises all buffered tokens except the last 3, and the first one waits until
  15 + 3 tokens are buffered (returns an empty array until then). ``final=True`` synthesises the rest,
  with the lookahead replaced by zero padding as upstream does.
- Every synthesised token gives 2 mel frames = 960 samples. HiFT output is held back by 8 mel frames
  (3840 samples) to cross-fade with the next call (Hamming window, as upstream), so a stream of N tokens
  yields exactly N * 960 samples in total once flushed.
- Attention caches are truncated after each chunk exactly as upstream does (``FlowCache.truncated``)
  so memory per stream is bounded however long the utterance is.

Noise and independence: the flow's starting noise is drawn per absolute mel frame from a generator
owned by the stream (seeded by ``seed``), in fixed 50-frame blocks, so output does not depend on the
chunking or on other streams; the voice's prompt frames use noise from a fixed voice seed. HiFT's NSF
noise comes from a second per-stream generator. Offline ``synthesize(voice, tokens, seed)`` uses the
same frame noise as a stream with the same seed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from backends.token2wav.config import load_flow
from backends.token2wav.cuda_graph import GraphedCall
from backends.token2wav.flow import CausalMaskedDiffWithXvec, FlowCache
from backends.token2wav.hift import HiFTGenerator, load_hift

SAMPLE_RATE = 24000
NUM_SPEECH_TOKENS = 6561          # FSQ codes 0..6560
SILENCE_TOKEN = 4218              # Step-Audio2's lookahead pad when preparing a voice
FIRST_CHUNK_TOKENS = 15           # tokens synthesised by the first streaming call (+ lookahead)
HIFT_CACHE_FRAMES = 8             # mel frames re-fed to HiFT for the cross-fade (160 ms)
CACHE_RECENT_FRAMES = 100         # frames kept besides the prompt when truncating caches
VOICE_NOISE_SEED = 0x5EED         # noise for the prompt frames of every voice (fixed: voices are shared)
NOISE_BLOCK_FRAMES = 50           # frame noise is drawn in blocks of this size (chunking-independent)
N_TIMESTEPS = 10

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


@dataclass(frozen=True)
class VoiceConditioning:
    """Everything reusable for one voice; read-only after prepare_voice, safe to share between streams."""

    prompt_tokens: torch.Tensor        # (1, Tp) int64, device
    prompt_mel: torch.Tensor           # (1, 2*Tp, 80), device, model dtype
    speaker_embedding: torch.Tensor    # (1, 192), device, model dtype
    projected_speaker: torch.Tensor    # (1, 80), device, model dtype
    prompt_noise: torch.Tensor         # (1, 80, 2*Tp) float32 CPU: the noise used for the prompt frames
    prompt_cache: FlowCache            # flow caches after the prompt (+ lookahead pad)
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
    flow_cache: Optional[FlowCache]
    pending: list[int] = field(default_factory=list)   # fed but not yet synthesised (incl. lookahead)
    started: bool = False                               # first chunk synthesised
    finished: bool = False
    hift_mel: Optional[torch.Tensor] = None             # (1, 80, <=8) last mel frames
    hift_source: Optional[torch.Tensor] = None          # (1, 1, <=3840) last excitation samples
    hift_speech: Optional[torch.Tensor] = None          # (1, <=3840) held-back samples for the cross-fade
    tokens_fed: int = 0
    samples_out: int = 0


class Token2WavEngine:
    sample_rate: int = SAMPLE_RATE

    def __init__(self, flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator, device: Union[str, torch.device] = "cpu",
                 dtype: Union[str, torch.dtype] = "float32", n_timesteps: int = N_TIMESTEPS, cuda_graphs: bool = False,
                 graph_mib: int = 16384):
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.flow = flow.to(device=self.device, dtype=self.dtype).eval()
        # HiFT keeps its F0 predictor and source path in fp32 (rounding F0 detunes the harmonics):
        # set_compute_dtype casts only the rest.
        self.hift = hift.to(device=self.device).set_compute_dtype(self.dtype).eval()
        self.n_timesteps = n_timesteps
        self.mel_channels = self.flow.output_size
        self.lookahead = self.flow.pre_lookahead_len
        self.samples_per_frame = int(getattr(hift, "samples_per_frame", 480))
        self.samples_per_token = self.samples_per_frame * self.flow.up_rate
        self.hift_cache_samples = HIFT_CACHE_FRAMES * self.samples_per_frame
        # Hamming window of twice the overlap, as upstream; float64 like upstream's numpy window.
        self.fade_window = torch.hamming_window(2 * self.hift_cache_samples, periodic=False, dtype=torch.float64)
        # The estimator solve and HiFT's decoder are launch-bound on a GPU: replay them from CUDA graphs.
        # The solve returns only each chunk's own attention-cache frames (new_only): the engine prepends
        # them to each stream's old cache, and a CUDA graph's static output stays chunk-sized.
        self.solve = functools.partial(self.flow.decoder.forward_chunk, new_only=True)
        self.encode = self._encode
        self.graphed_solve: Optional[GraphedCall] = None
        if cuda_graphs and self.device.type == "cuda":
            self.graphed_solve = GraphedCall(self.solve, max_bytes=graph_mib << 20)
            self.solve = self.graphed_solve
            self.encode = GraphedCall(self._encode, max_bytes=2 << 30)
            self.hift.enable_cuda_graphs(max_shapes=32)  # batch 1..8 (powers of two) x the schedule's chunk sizes

    # ---- loading ----

    @classmethod
    def load(cls, model_dir: Union[str, Path], device: str = "cpu", dtype: str = "float32",
             cuda_graphs: bool = False, graph_mib: int = 16384) -> "Token2WavEngine":
        """Read flow.yaml, flow.pt and hift.pt from a Step-Audio2 token2wav folder; strict state-dict loads."""
        model_dir = Path(model_dir)
        for name in ("flow.yaml", "flow.pt", "hift.pt"):
            if not (model_dir / name).is_file():
                raise FileNotFoundError(f"{model_dir / name} is missing (need flow.yaml, flow.pt, hift.pt)")
        flow = load_flow(model_dir / "flow.yaml")
        state = torch.load(model_dir / "flow.pt", map_location="cpu", weights_only=True)
        flow.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        del state
        hift = load_hift(model_dir / "hift.pt", device="cpu", dtype=torch.float32,
                         **hift_hyperparams_from_checkpoint(model_dir / "hift.pt"))
        return cls(flow, hift, device=device, dtype=dtype, cuda_graphs=cuda_graphs, graph_mib=graph_mib)

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
        return VoiceConditioning(prompt, mel_dev, spk_dev, self.flow.project_speaker(spk_dev), prompt_noise,
                                 cache, lookahead_pad)

    # ---- streaming ----

    def start_stream(self, voice: VoiceConditioning, seed: int = 0) -> StreamState:
        return StreamState(
            voice=voice,
            seed=int(seed),
            flow_noise=FrameNoise(seed, self.mel_channels),
            # a different stream of numbers than the flow noise, still a function of the seed only
            # on the engine's device: drawing NSF noise on the host and copying costs ms per chunk on a GPU
            hift_generator=torch.Generator(device=self.device).manual_seed(int(seed) ^ 0x48494654),
            flow_cache=voice.prompt_cache,
        )

    @torch.inference_mode()
    def feed(self, state: StreamState, tokens: TokensLike, final: bool) -> np.ndarray:
        """Append tokens; return the PCM (float32, 24 kHz, mono) that became ready, possibly empty."""
        ids = validate_tokens(tokens)
        if state.finished:
            raise RuntimeError("this stream was already finished (final=True); start a new stream")
        state.pending.extend(ids)
        state.tokens_fed += len(ids)
        if final:
            state.finished = True
            if not state.pending:
                pcm = state.hift_speech[0] if state.hift_speech is not None else torch.zeros(0)
            else:
                mel = self._flow_chunk(state, state.pending, last_chunk=True)
                pcm = self._vocode(state, mel, final=True)
            self._release(state)
            return self._emit(state, pcm)

        ready = len(state.pending) - self.lookahead
        if ready < (1 if state.started else FIRST_CHUNK_TOKENS):
            return np.zeros(0, dtype=np.float32)
        mel = self._flow_chunk(state, state.pending, last_chunk=False)
        state.pending = state.pending[ready:]
        state.started = True
        return self._emit(state, self._vocode(state, mel, final=False))

    @torch.inference_mode()
    def feed_many(self, items: Sequence[tuple[StreamState, TokensLike, bool]]) -> list[Union[np.ndarray, Exception]]:
        """``feed`` for several streams at once: chunks of equal shape run as one batched flow call.

        Each item is (state, tokens, final); the result list holds, per item, its PCM or the exception
        its feed raised (that stream is unusable afterwards, as after a failed ``feed``). Chunks are
        batched when they have the same token count, the same cache lengths and the same final flag
        (streams at the same point of the same schedule with voices of equal prompt length); anything
        else runs in a smaller batch. The output of each stream is what ``feed`` would give, up to
        floating-point rounding of the batched matrix products.
        """
        results: list[Union[np.ndarray, Exception, None]] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for index, (state, tokens, final) in enumerate(items):
            try:
                ids = validate_tokens(tokens)
                if state.finished:
                    raise RuntimeError("this stream was already finished (final=True); start a new stream")
                state.pending.extend(ids)
                state.tokens_fed += len(ids)
                if final:
                    state.finished = True
                    if not state.pending:
                        pcm = state.hift_speech[0] if state.hift_speech is not None else torch.zeros(0)
                        self._release(state)
                        results[index] = self._emit(state, pcm)
                        continue
                elif len(state.pending) - self.lookahead < (1 if state.started else FIRST_CHUNK_TOKENS):
                    results[index] = np.zeros(0, dtype=np.float32)
                    continue
                cache = state.flow_cache
                key = (bool(final), len(state.pending), tuple(cache.conformer_att.shape), tuple(cache.estimator_att.shape))
                groups.setdefault(key, []).append(index)
            except Exception as exc:  # noqa: BLE001 - reported per stream
                results[index] = exc
        for (final, *_), members in groups.items():
            states = [items[i][0] for i in members]
            try:
                mels = self._flow_chunks(states, [list(s.pending) for s in states], last_chunk=final)
                if not final:
                    for state in states:
                        state.pending = state.pending[len(state.pending) - self.lookahead:]
                        state.started = True
                pcms = self._vocode_many(states, mels, final=final)
                if final:
                    for state in states:
                        self._release(state)
                for i, out in zip(members, self._emit_many(states, pcms)):
                    results[i] = out
            except Exception as exc:  # noqa: BLE001 - the whole batch failed: every member's stream is unusable
                for i in members:
                    results[i] = exc
        return results  # type: ignore[return-value]

    def state_nbytes(self, state: StreamState) -> int:
        """Approximate bytes held by this stream alone (the shared voice is not counted)."""
        held = 0
        if state.flow_cache is not None and state.flow_cache is not state.voice.prompt_cache:
            held += state.flow_cache.nbytes()
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
        """One flow chunk for each stream, as one batch: equal token counts and cache shapes required.

        Batch layouts: the conformer caches stack streams on their batch axis; the estimator caches hold
        the CFG halves as [cond of every stream, uncond of every stream] on axis 2, the layout the solver
        uses. Each stream then gets its own copy of its rows (never a view of the batch, nor of a CUDA
        graph's static output), truncated as upstream does.
        """
        flow, batch = self.flow, len(states)
        caches = [s.flow_cache for s in states]
        token_tensor = torch.tensor(tokens, dtype=torch.long, device=self.device)
        mu, conformer_cnn, conformer_att = self.encode(
            flow.input_embedding(token_tensor), _stack([c.conformer_cnn for c in caches], 0),
            _stack([c.conformer_att for c in caches], 1), last_chunk)
        frames = mu.shape[2]
        noise = torch.cat([s.flow_noise.take(frames) for s in states]).to(self.device, self.dtype)
        spks = _stack([s.voice.projected_speaker for s in states], 0)
        # With CUDA graphs the batch is padded to a power of two with copies of the first stream's rows
        # (their output is dropped): a few batch sizes instead of every one keeps the graph count low.
        rows = batch if self.graphed_solve is None else 1 << (batch - 1).bit_length()
        filler = rows - batch
        if filler:
            mu, noise, spks = (torch.cat([t, t[:1].expand(filler, *t.shape[1:])]) for t in (mu, noise, spks))
        estimator_caches = caches + [caches[0]] * filler
        mel, estimator_cnn, estimator_att = self.solve(
            mu, spks, torch.zeros_like(mu), noise, self.n_timesteps,
            _cfg_stack([c.estimator_cnn for c in estimator_caches]),
            _cfg_stack([c.estimator_att for c in estimator_caches]))
        mels = []
        for i, state in enumerate(states):
            own = torch.tensor([i], device=self.device)
            cfg_rows = torch.tensor([i, rows + i], device=self.device)
            state.flow_cache = FlowCache(
                conformer_cnn.index_select(0, own), conformer_att.index_select(1, own),
                estimator_cnn.index_select(2, cfg_rows),
                torch.cat([estimator_att.index_select(2, cfg_rows), caches[i].estimator_att], dim=4),
            ).truncated(state.voice.prompt_frames, CACHE_RECENT_FRAMES)
            mels.append(mel[i:i + 1].clone())
        return mels

    def _encode(self, embedded: torch.Tensor, cnn_cache: torch.Tensor, att_cache: torch.Tensor,
                last_chunk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conformer encoder + projection of one (batched) chunk: mu (b, 80, frames) and the new caches."""
        h, cnn, att = self.flow.encoder.forward_chunk(embedded, last_chunk, cnn_cache, att_cache)
        return self.flow.encoder_proj(h).transpose(1, 2).contiguous(), cnn, att

    def _vocode(self, state: StreamState, chunk_mel: torch.Tensor, final: bool) -> torch.Tensor:
        """Mel chunk -> the samples that are final now (all of them when final)."""
        return self._vocode_many([state], [chunk_mel], final)[0]

    def _vocode_many(self, states: list[StreamState], chunk_mels: list[torch.Tensor], final: bool) -> list[torch.Tensor]:
        """``_vocode`` for several streams: one batched HiFT call when their mel and excitation caches
        have equal shapes (streams at the same point of the schedule), one call each otherwise.

        Why: HiFT at batch 1 costs a few ms per stream even from a CUDA graph, so vocoding the streams
        of a batched flow call one by one made every extra stream in the batch add that much latency.
        Each stream keeps its own NSF noise (one generator per row), so its samples do not depend on
        which streams it was batched with.
        """
        mels = [m if s.hift_mel is None else torch.cat([s.hift_mel, m], dim=2) for s, m in zip(states, chunk_mels)]
        sources = [s.hift_source for s in states]
        if len({tuple(m.shape) for m in mels}) > 1 or len({None if c is None else tuple(c.shape) for c in sources}) > 1:
            return [pcm for s, m in zip(states, chunk_mels) for pcm in self._vocode_many([s], [m], final)]
        cache = None if sources[0] is None else _stack(sources, 0)
        generators = [s.hift_generator for s in states]
        speech, source = self.hift.inference(_stack(mels, 0), cache,
                                             generator=generators if len(generators) > 1 else generators[0])
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
        window = self.fade_window.to(speech.device)
        faded = speech.clone()
        head = speech[..., :overlap].double() * window[:overlap] + previous[..., -overlap:].double() * window[overlap:]
        faded[..., :overlap] = head.to(speech.dtype)
        return faded

    def _emit(self, state: StreamState, pcm: torch.Tensor) -> np.ndarray:
        return self._emit_many([state], [pcm])[0]

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


def _stack(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def _cfg_stack(caches: list[torch.Tensor]) -> torch.Tensor:
    """Per-stream estimator caches (..., 2 = cond/uncond on axis 2, ...) -> [cond..., uncond...] on axis 2."""
    if len(caches) == 1:
        return caches[0]
    return torch.cat([c.narrow(2, 0, 1) for c in caches] + [c.narrow(2, 1, 1) for c in caches], dim=2)


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
