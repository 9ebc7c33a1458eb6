"""HiFT vocoder of the Step-Audio2 token2wav: NSF-HiFiGAN with an iSTFT head.

mel [B, 80, T] at 50 Hz  ->  waveform [B, T * 480] at 24 kHz.

Pipeline (HiFTNet, arXiv 2309.09493):
  1. an F0 predictor (5 weight-normed convs + a linear head) turns the mel into F0 per frame;
  2. the neural-source-filter (NSF) module turns F0 into a harmonic excitation at the sample rate
     (sines of F0 and its harmonics, voiced/unvoiced mask, additive Gaussian noise, merged by a
     linear layer + tanh);
  3. the generator upsamples the mel by 8*5*3 with transposed convs and residual blocks, fusing in
     the STFT of the excitation at every scale; a final conv predicts log-magnitude and phase of a
     16-point STFT with hop 4, and an iSTFT makes the waveform.

Parameter names mirror the published `hift.pt` (after stripping its `generator.` prefix) so it loads
with `strict=True`. Weight norm uses torch's parametrization API; its load hook also accepts the old
`weight_g`/`weight_v` keys.

Randomness: the excitation draws an initial harmonic phase and Gaussian noise on every call, from the
`generator` passed to `inference` (torch's global RNG when None), so a stream that owns its generator
is independent of other streams. A generator on the model's device avoids a host draw and copy. By
default the noise is drawn in a cheaper, equally distributed form; with `reference_noise_layout=True`
the draws match upstream's exactly, so a seeded call reproduces the reference up to float rounding.

Precision: the excitation (phase accumulation over thousands of samples), the STFT/iSTFT and the
exp() of the log-magnitude always run in float32; `set_compute_dtype` (used by `load_hift`) puts only
the upsampling network in fp16/bf16 and keeps the F0 predictor and source module in float32.

Speed: on a GPU at batch 1 the decoder is launch-bound; `enable_cuda_graphs` / `load_hift(cuda_graphs=
True)` replays it from CUDA graphs (hift_cuda_graph.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from backends.token2wav.hift_cuda_graph import GraphedDecode

# The published Step-Audio2 hift.pt uses the reference defaults.
DEFAULT_HIFT_CONFIG: dict[str, Any] = {
    "in_channels": 80,
    "base_channels": 512,
    "nb_harmonics": 8,
    "sampling_rate": 24000,
    "nsf_alpha": 0.1,
    "nsf_sigma": 0.003,
    "nsf_voiced_threshold": 10,
    "upsample_rates": (8, 5, 3),
    "upsample_kernel_sizes": (16, 11, 7),
    "istft_params": {"n_fft": 16, "hop_len": 4},
    "resblock_kernel_sizes": (3, 7, 11),
    "resblock_dilation_sizes": ((1, 3, 5),) * 3,
    "source_resblock_kernel_sizes": (7, 7, 11),
    "source_resblock_dilation_sizes": ((1, 3, 5),) * 3,
    "lrelu_slope": 0.1,
    "audio_limit": 0.99,
    "f0_predictor_channels": 512,
}

# Same geometry (480 samples per mel frame at 24 kHz), a few hundred times fewer weights: for tests.
TINY_HIFT_CONFIG: dict[str, Any] = {
    **DEFAULT_HIFT_CONFIG,
    "base_channels": 32,
    "f0_predictor_channels": 32,
}

CHECKPOINT_PREFIX = "generator."
# Sub-modules that load_hift keeps in float32 whatever the requested dtype (see load_hift).
FLOAT32_CHILDREN = ("f0_predictor", "m_source")


def _same_padding(kernel_size: int, dilation: int = 1) -> int:
    """Padding that keeps the length of a stride-1 conv."""
    return (kernel_size * dilation - dilation) // 2


class Snake(nn.Module):
    """Periodic activation x + sin^2(alpha x) / alpha with a learned per-channel alpha."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        self.eps = 1e-9

    def forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + self.eps)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Residual stack: per dilation, snake -> dilated conv -> snake -> conv, added to the input."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_same_padding(kernel_size, d)))
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=_same_padding(kernel_size)))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class F0Predictor(nn.Module):
    """mel -> non-negative F0 in Hz per frame (named `ConvRNNF0Predictor` upstream; it has no RNN)."""

    def __init__(self, in_channels: int = 80, channels: int = 512, num_layers: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(num_layers):
            layers.append(weight_norm(nn.Conv1d(in_channels if i == 0 else channels, channels, 3, padding=1)))
            layers.append(nn.ELU())
        self.condnet = nn.Sequential(*layers)  # convs at indices 0, 2, 4, ... as in the checkpoint
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        hidden = self.condnet(mel).transpose(1, 2)
        return self.classifier(hidden).squeeze(-1).abs()  # [B, T]


class SourceModule(nn.Module):
    """Harmonic-plus-noise NSF excitation at the sample rate (upstream `SourceModuleHnNSF2`).

    Only `l_linear` carries weights; everything else is computed in float32.
    """

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        harmonic_num: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
        reference_noise_layout: bool = False,
    ) -> None:
        super().__init__()
        self.reference_noise_layout = reference_noise_layout
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.harmonic_num = harmonic_num
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(harmonic_num + 1, 1)

    def forward(self, f0_samples: Tensor, generator: Generators) -> Tensor:
        """f0_samples [B, L, 1] in Hz (frame F0 repeated per sample) -> excitation [B, L, 1], float32."""
        f0 = f0_samples.float()
        batch = f0.shape[0]
        num_sines = self.harmonic_num + 1
        harmonics = torch.arange(1, num_sines + 1, device=f0.device, dtype=torch.float32)
        freqs = f0 * harmonics  # [B, L, H]

        # Phase advance per sample in cycles; a random start phase per overtone (the fundamental starts at 0).
        cycles_per_sample = (freqs / self.sampling_rate) % 1
        start_phase = _draw_like(freqs.new_empty(batch, num_sines), generator, normal=False)
        start_phase[:, 0] = 0
        cycles_per_sample[:, 0, :] = cycles_per_sample[:, 0, :] + start_phase

        # Accumulate the phase at frame rate and interpolate it back up: keeps the sines smooth across
        # frame boundaries and keeps the cumulative sum short (it runs over T, not T*480).
        per_frame = F.interpolate(
            cycles_per_sample.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear"
        )
        phase = torch.cumsum(per_frame, dim=2) * (2 * math.pi)
        phase = F.interpolate(phase * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear")
        sines = torch.sin(phase.transpose(1, 2)) * self.sine_amp  # [B, L, H]

        voiced = (f0 > self.voiced_threshold).float()  # [B, L, 1]
        noise_amp = voiced * self.noise_std + (1 - voiced) * (self.sine_amp / 3)
        weight, bias = self.l_linear.weight.float(), self.l_linear.bias.float()

        if self.reference_noise_layout:
            # Upstream's draw, bit for bit (for seeded parity tests): one Gaussian per sample and
            # harmonic into a tensor strided like `sines` (a transposed view). torch fills such a
            # non-contiguous tensor with a slower scalar loop that yields other numbers than the
            # vectorised one: ~15x slower on CPU (27 ms for a 1.2 s chunk).
            noise = noise_amp * _draw_like(sines, generator, normal=True)
            return torch.tanh(F.linear(sines * voiced + noise, weight, bias))

        # Default: the merge layer is linear, so the H independent N(0, amp^2) noises it mixes equal one
        # N(0, amp^2 * |w|^2) per sample in distribution. Drawing that one is H (9) times fewer numbers,
        # which matters when the caller's generator lives on the CPU and the model on a GPU.
        mixed_noise = noise_amp * weight.norm() * _draw_like(noise_amp, generator, normal=True)
        return torch.tanh(F.linear(sines * voiced, weight, bias) + mixed_noise)


Generators = Union[torch.Generator, Sequence[torch.Generator], None]


def _draw_like(like: Tensor, generator: Generators, *, normal: bool) -> Tensor:
    """Uniform [0,1) or standard normal float32 noise shaped and strided like `like`.

    Drawn on the generator's device (the tensor's when None: global RNG), then moved to `like`'s device.
    A sequence of generators draws row b of the batch from generator b, the same numbers a batch-1 call
    with that generator draws: streams vocoded together get what they would get alone.
    """
    if isinstance(generator, (list, tuple)):
        if len(generator) != like.shape[0]:
            raise ValueError(f"{len(generator)} generators for a batch of {like.shape[0]}")
        return torch.cat([_draw_like(like[b:b + 1], g, normal=normal) for b, g in enumerate(generator)])
    draw_device = generator.device if generator is not None else like.device
    out = torch.empty_strided(like.shape, like.stride(), dtype=torch.float32, device=draw_device)
    out = out.normal_(generator=generator) if normal else out.uniform_(generator=generator)
    return out.to(like.device)


class HiFTGenerator(nn.Module):
    """NSF-HiFiGAN + iSTFT vocoder; see the module docstring. Hyperparameter names follow upstream."""

    def __init__(
        self,
        in_channels: int = 80,
        base_channels: int = 512,
        nb_harmonics: int = 8,
        sampling_rate: int = 24000,
        nsf_alpha: float = 0.1,
        nsf_sigma: float = 0.003,
        nsf_voiced_threshold: float = 10,
        upsample_rates: Sequence[int] = (8, 5, 3),
        upsample_kernel_sizes: Sequence[int] = (16, 11, 7),
        istft_params: Mapping[str, int] | None = None,
        resblock_kernel_sizes: Sequence[int] = (3, 7, 11),
        resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5),) * 3,
        source_resblock_kernel_sizes: Sequence[int] = (7, 7, 11),
        source_resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5),) * 3,
        lrelu_slope: float = 0.1,
        audio_limit: float = 0.99,
        f0_predictor_channels: int = 512,
        reference_noise_layout: bool = False,
    ) -> None:
        """reference_noise_layout: draw the NSF noise exactly as upstream does (slow; parity tests)."""
        super().__init__()
        istft = dict(istft_params or {"n_fft": 16, "hop_len": 4})
        self.n_fft = int(istft["n_fft"])
        self.hop_len = int(istft["hop_len"])
        self.sampling_rate = sampling_rate
        self.lrelu_slope = lrelu_slope
        self.audio_limit = audio_limit
        self.num_kernels = len(resblock_kernel_sizes)
        self.num_upsamples = len(upsample_rates)
        self.samples_per_frame = math.prod(upsample_rates) * self.hop_len
        spec_channels = self.n_fft + 2  # real and imaginary halves of n_fft//2+1 bins

        self.m_source = SourceModule(
            sampling_rate, self.samples_per_frame, nb_harmonics, nsf_alpha, nsf_sigma, nsf_voiced_threshold,
            reference_noise_layout,
        )
        self.conv_pre = weight_norm(nn.Conv1d(in_channels, base_channels, 7, padding=3))
        self.ups = nn.ModuleList(
            weight_norm(
                nn.ConvTranspose1d(base_channels // 2**i, base_channels // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            )
            for i, (u, k) in enumerate(zip(upsample_rates, upsample_kernel_sizes))
        )

        # The excitation's STFT enters at every scale, strided down to that scale's frame rate.
        # Stage i runs at prod(upsample_rates[:i+1]) times the mel rate; the last stage needs no striding.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        rates = list(upsample_rates)
        for i, (k, d) in enumerate(zip(source_resblock_kernel_sizes, source_resblock_dilation_sizes)):
            stride = math.prod(rates[i + 1 :])
            ch = base_channels // 2 ** (i + 1)
            if stride == 1:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, 1))
            else:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, stride * 2, stride, padding=stride // 2))
            self.source_resblocks.append(ResBlock(ch, k, d))

        self.resblocks = nn.ModuleList(
            ResBlock(base_channels // 2 ** (i + 1), k, d)
            for i in range(self.num_upsamples)
            for k, d in zip(resblock_kernel_sizes, resblock_dilation_sizes)
        )
        last_channels = base_channels // 2**self.num_upsamples
        self.conv_post = weight_norm(nn.Conv1d(last_channels, spec_channels, 7, padding=3))
        self.f0_predictor = F0Predictor(in_channels, f0_predictor_channels)
        self._graphed_decode: GraphedDecode | None = None  # see enable_cuda_graphs

    @property
    def conv_dtype(self) -> torch.dtype:
        """The dtype the convolutions run in (biases are never parametrized, so this is always a leaf)."""
        return self.conv_pre.bias.dtype

    # ---- spectral helpers (always float32) ----

    def _window(self, device: torch.device) -> Tensor:
        return torch.hann_window(self.n_fft, periodic=True, dtype=torch.float32, device=device)

    def _source_spectrum(self, source: Tensor) -> Tensor:
        """source [B, 1, L] -> [B, n_fft+2, L/hop+1]: real parts then imaginary parts."""
        spec = torch.stft(
            source.squeeze(1).float(), self.n_fft, self.hop_len, self.n_fft,
            window=self._window(source.device), return_complex=True,
        )
        return torch.cat([spec.real, spec.imag], dim=1)

    def _istft(self, head: Tensor) -> Tensor:
        """conv_post output [B, n_fft+2, frames] -> waveform [B, hop*(frames-1)]."""
        head = head.float()
        bins = self.n_fft // 2 + 1
        magnitude = torch.exp(head[:, :bins]).clamp(max=1e2)
        phase = torch.sin(head[:, bins:])  # upstream squashes the phase with sin; mirrored for parity
        spec = torch.polar(magnitude, phase)
        return self._overlap_add_istft(spec)

    def _overlap_add_istft(self, spec: Tensor) -> Tensor:
        """torch.istft(spec, n_fft, hop, n_fft, window, center=True) written out.

        torch.istft checks the window envelope with a host sync, which CUDA-graph capture forbids; this
        is the same arithmetic (inverse rFFT, window, overlap-add, divide by the summed squared window,
        drop n_fft//2 samples at both ends) without the check: a periodic Hann window at hop n_fft/4 has
        a constant envelope.
        """
        window = self._window(spec.device)
        frames = torch.fft.irfft(spec, n=self.n_fft, dim=1) * window[None, :, None]  # [B, n_fft, F]
        num_frames = frames.shape[-1]
        padded_length = self.n_fft + self.hop_len * (num_frames - 1)

        def overlap_add(columns: Tensor) -> Tensor:
            folded = F.fold(columns, output_size=(1, padded_length), kernel_size=(1, self.n_fft), stride=(1, self.hop_len))
            return folded.flatten(1)

        signal = overlap_add(frames)
        envelope = overlap_add(window.square()[None, :, None].expand(1, -1, num_frames))
        trim = self.n_fft // 2
        return signal[:, trim:-trim] / envelope[:, trim:-trim]

    # ---- forward ----

    def excitation(self, speech_feat: Tensor, generator: Generators = None) -> Tensor:
        """mel [B, C, T] -> NSF excitation [B, 1, T*samples_per_frame], float32."""
        f0 = self.f0_predictor(speech_feat.to(self.f0_predictor.classifier.weight.dtype))  # [B, T]
        f0_samples = f0.float().repeat_interleave(self.samples_per_frame, dim=1).unsqueeze(-1)
        return self.m_source(f0_samples, generator).transpose(1, 2)

    def decode(self, speech_feat: Tensor, source: Tensor) -> Tensor:
        """mel [B, C, T] + excitation [B, 1, L] -> waveform [B, L] float32."""
        dtype = self.conv_dtype
        source_spec = self._source_spectrum(source).to(dtype)
        x = self.conv_pre(speech_feat.to(dtype))
        for i in range(self.num_upsamples):
            x = self.ups[i](F.leaky_relu(x, self.lrelu_slope))
            if i == self.num_upsamples - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # one frame at the front: hop*frames + 1 STFT frames
            x = x + self.source_resblocks[i](self.source_downs[i](source_spec))
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            x = sum(block(x) for block in blocks) / self.num_kernels
        x = self.conv_post(F.leaky_relu(x))  # default slope (0.01) here, as upstream
        wav = self._istft(x)
        return wav.clamp(-self.audio_limit, self.audio_limit)

    @staticmethod
    def _has_wn(module: nn.Module) -> bool:
        return parametrize.is_parametrized(module, "weight")

    @torch.inference_mode()
    def inference(
        self,
        speech_feat: Tensor,
        cache_source: Tensor | None = None,
        generator: Generators = None,
        capture: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """mel [B, 80, T] -> (wav [B, T*480] float32, excitation [B, 1, T*480] float32).

        cache_source [B, 1, S]: the tail of the previous call's excitation; it replaces the first S
        samples of this call's excitation so the harmonic phase stays continuous across chunks (the
        caller re-feeds the matching mel frames in front of the new chunk, as upstream does).
        generator: source of the NSF noise (global RNG when None); a sequence gives each row its own.
        capture: with CUDA graphs, whether this shape may be captured now (False: replay or run eagerly).
        """
        source = self.excitation(speech_feat, generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            cached = cache_source.shape[-1]
            if cached > source.shape[-1]:
                raise ValueError(f"cache_source has {cached} samples, more than the {source.shape[-1]} generated")
            source[:, :, :cached] = cache_source.to(source)
        if self._graphed_decode is not None:
            return self._graphed_decode(speech_feat, source, capture=capture), source
        return self.decode(speech_feat, source), source

    def enable_cuda_graphs(self, max_shapes: int = 4) -> None:
        """Replay `decode` from CUDA graphs, captured lazily per input shape (no effect on CPU inputs).

        Enable once the model has its final device and dtype: a graph keeps the weights it captured.
        """
        self._graphed_decode = GraphedDecode(self.decode, max_shapes=max_shapes)

    def forward(self, speech_feat: Tensor, cache_source: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.inference(speech_feat, cache_source)

    def set_compute_dtype(self, dtype: torch.dtype) -> HiFTGenerator:
        """Cast the convolution path to `dtype`, keeping the F0 predictor and source module float32.

        Use this instead of `.to(dtype)` / `.half()` (those cast everything). F0 sets the pitch of every
        harmonic and its error accumulates in the phase: with bf16 F0 weights or activations (8-bit
        mantissa, ~0.5 Hz steps at 150 Hz) the excitation drifts audibly. The predictor runs at frame
        rate, a few % of the FLOPs, so float32 costs little. Call it on float32 weights: weights already
        rounded to a low precision do not come back.
        """
        if self._graphed_decode is not None and self._graphed_decode.num_graphs:
            raise RuntimeError("set the dtype before the first CUDA-graph capture")
        for name, child in self.named_children():
            child.to(dtype=torch.float32 if name in FLOAT32_CHILDREN else dtype)
        return self

    def fold_weight_norm(self) -> None:
        """Bake every weight-norm parametrization into a plain weight (saves work per call).

        Do this after loading (it changes the state-dict keys) and in float32 (before a dtype cast).
        """
        for module in self.modules():
            if self._has_wn(module):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def _strip_prefix(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k[len(CHECKPOINT_PREFIX):] if k.startswith(CHECKPOINT_PREFIX) else k: v for k, v in state.items()}


def load_hift(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    fold_weight_norm: bool = True,
    cuda_graphs: bool = False,
    **hyperparams: Any,
) -> HiFTGenerator:
    """Read a hift.pt (`generator.`-prefixed; weight_g/weight_v or parametrization keys), strict load.

    The weights are loaded and (optionally) folded in float32 on the CPU, then moved to device/dtype.
    cuda_graphs: replay the decoder from CUDA graphs on CUDA inputs (see enable_cuda_graphs).
    Returns the model in eval mode.
    """
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    model = HiFTGenerator(**{**DEFAULT_HIFT_CONFIG, **hyperparams})
    # torch's weight-norm parametrization registers a load hook that maps weight_g/weight_v to
    # parametrizations.weight.original0/original1, so both layouts load strictly here.
    model.load_state_dict({k: v.float() for k, v in _strip_prefix(state).items()}, strict=True)
    if fold_weight_norm:
        model.fold_weight_norm()
    model = model.to(device=device).set_compute_dtype(dtype).eval()
    if cuda_graphs:
        model.enable_cuda_graphs()
    return model


def to_old_weight_norm_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Rename parametrization keys to the pre-2.1 `weight_g`/`weight_v` form the published file uses."""
    renamed: dict[str, Tensor] = {}
    for key, value in state.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        key = key.replace("parametrizations.weight.original1", "weight_v")
        renamed[key] = value
    return renamed


def write_random_hift(
    path: str | Path,
    config: Mapping[str, Any] | None = None,
    seed: int = 0,
    old_weight_norm: bool = True,
) -> dict[str, Any]:
    """Write a random-weight hift.pt in the published layout; returns the hyperparameters used.

    Weights are torch's default init, deterministic in `seed` (upstream's N(0, 0.01) init_weights is a
    no-op on parametrized weights, so this is also what the reference builds), except the F0 head:
    weights x1500 and bias 100 Hz, so F0 varies and most frames are voiced (with default weights F0
    would sit below the voiced threshold and the harmonic branch would never run).
    """
    used = {**DEFAULT_HIFT_CONFIG, **(dict(config) if config else {})}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HiFTGenerator(**used)
        with torch.no_grad():
            model.f0_predictor.classifier.weight.mul_(1500.0)
            model.f0_predictor.classifier.bias.fill_(100.0)
    state = model.state_dict()
    if old_weight_norm:
        state = to_old_weight_norm_keys(state)
    torch.save({CHECKPOINT_PREFIX + k: v.contiguous() for k, v in state.items()}, str(path))
    return used
