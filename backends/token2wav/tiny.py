"""Write a random-weight token2wav folder (flow.yaml, flow.pt, hift.pt) in the published file formats.

"tiny": small dims, runs fast on a CPU (tests, CI). "full": the published dims (155.8 M flow parameters,
HiFT reference defaults), for GPU benchmarks with random weights.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from backends.token2wav.config import build_flow_from_yaml, flow_yaml_text
from backends.token2wav.hift import DEFAULT_HIFT_CONFIG, TINY_HIFT_CONFIG, write_random_hift

_FLOW_COMMON: dict[str, Any] = dict(output_size=80, spk_embed_dim=192, output_type="mel", vocab_size=6561)
_ENCODER_COMMON: dict[str, Any] = dict(
    input_layer="linear", pre_lookahead_len=3, up_stride=2, up_scale_factor=2,
    pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", key_bias=True,
    dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.1, normalize_before=True,
)

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "flow": dict(input_size=32, **_FLOW_COMMON),
        "encoder": dict(input_size=32, output_size=32, num_blocks=2, num_up_blocks=2, attention_heads=2,
                        linear_units=64, **_ENCODER_COMMON),
        "decoder": dict(inference_cfg_rate=0.7),
        "estimator": dict(in_channels=320, out_channels=80, mlp_ratio=2.0, depth=2, num_heads=2, head_dim=16,
                          hidden_size=32),
    },
    "full": {
        "flow": dict(input_size=512, **_FLOW_COMMON),
        "encoder": dict(input_size=512, output_size=512, num_blocks=6, num_up_blocks=4, attention_heads=8,
                        linear_units=2048, **_ENCODER_COMMON),
        "decoder": dict(inference_cfg_rate=0.7),
        "estimator": dict(in_channels=320, out_channels=80, mlp_ratio=4.0, depth=16, num_heads=8, head_dim=64,
                          hidden_size=512),
    },
}

_HIFT_CONFIGS = {"tiny": TINY_HIFT_CONFIG, "full": DEFAULT_HIFT_CONFIG}


def randomize_flow_(flow: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with scaled Gaussian noise (deterministic in seed).

    Default init zeroes the DiT's adaLN and output layers, which would make the estimator output
    constant; random weights everywhere exercise every path. Matrices and conv kernels get std
    0.5/sqrt(fan_in) so activations stay O(1) (and finite in float16); LayerNorm weights sit around 1.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in flow.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2:
                fan_in = param[0].numel()   # in_features, or in_channels * kernel for convs
                param.copy_(noise * (0.5 / fan_in ** 0.5))
            else:
                is_norm_weight = name.endswith(("norm.weight", "norm_ff.weight", "norm_mha.weight", "out.1.weight",
                                                "block.3.weight", "q_norm.weight", "k_norm.weight"))
                param.copy_(noise * 0.1 + (1.0 if is_norm_weight else 0.0))


def write_token2wav_dir(path: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Create `path` with flow.yaml, flow.pt (published key layout) and hift.pt (`generator.` keys)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    yaml_text = flow_yaml_text(**SIZES[size])
    (out / "flow.yaml").write_text(yaml_text, encoding="utf-8")
    flow = build_flow_from_yaml(yaml_text)
    randomize_flow_(flow, seed)
    torch.save({k: v.contiguous() for k, v in flow.state_dict().items()}, out / "flow.pt")
    write_random_hift(out / "hift.pt", _HIFT_CONFIGS[size], seed)
    return out
