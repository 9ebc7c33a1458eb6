"""Fill trtllm-serve's ``--extra_llm_api_options`` file for this deployment.

The committed ``backends/llm/trtllm/llm.yaml`` holds the tuned values and their reasons; only the values
that depend on the deployment (how much GPU memory the KV cache may take, the largest batch the CUDA
graphs cover) are replaced here, so the CLI flags and the file never disagree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


def fill(options: dict, kv_cache_fraction: float, max_batch_size: int) -> dict:
    if not 0.0 < kv_cache_fraction < 1.0:
        raise SystemExit(f"LLM_KV_CACHE_FRACTION must be in (0, 1), got {kv_cache_fraction}")
    options.setdefault("kv_cache_config", {})["free_gpu_memory_fraction"] = kv_cache_fraction
    options.setdefault("cuda_graph_config", {})["max_batch_size"] = max_batch_size
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("template", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kv-cache-fraction", type=float, required=True)
    parser.add_argument("--max-batch-size", type=int, required=True)
    args = parser.parse_args()
    options = yaml.safe_load(args.template.read_text())
    filled = fill(options, args.kv_cache_fraction, args.max_batch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# Written by deploy/prepare/llm_options.py from backends/llm/trtllm/llm.yaml\n"
                        + yaml.safe_dump(filled, sort_keys=False))


if __name__ == "__main__":
    main()
