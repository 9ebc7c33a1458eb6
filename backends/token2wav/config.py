"""Our own reader for the published hyperpyyaml ``flow.yaml`` (no hyperpyyaml dependency).

The file builds the flow with ``!new:<module>.<Class>`` tags naming the reference's classes
(``cosyvoice2.flow.flow.CausalMaskedDiffWithXvec`` etc.). We parse it with PyYAML, keep tagged
mappings as inert nodes, and instantiate only the ``flow`` entry, mapping each known class name to
ours. Other hyperpyyaml tags (``!ref``, ``!name:``, ``!apply:``, unknown ``!new:``) elsewhere in the
file are tolerated and left unbuilt, so a file "as published, possibly with more keys" still loads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from backends.token2wav.dit import DiT
from backends.token2wav.encoder import UpsampleConformerEncoderV2
from backends.token2wav.flow import CausalMaskedDiffWithXvec
from backends.token2wav.flow_matching import CausalConditionalCFM

# Reference class path (after the "cosyvoice2." package prefix) -> our class.
CLASS_MAP: dict[str, type] = {
    "flow.flow.CausalMaskedDiffWithXvec": CausalMaskedDiffWithXvec,
    "flow.flow_matching.CausalConditionalCFM": CausalConditionalCFM,
    "flow.decoder_dit.DiT": DiT,
    "transformer.upsample_encoder_v2.UpsampleConformerEncoderV2": UpsampleConformerEncoderV2,
}

TAG_PREFIX = "cosyvoice2."


@dataclass
class TaggedNode:
    """A YAML value carrying a hyperpyyaml tag, e.g. tag='!new:', target='cosyvoice2.flow.flow.X'."""

    tag: str
    target: str
    value: Any = field(default=None)


class _FlowYamlLoader(yaml.SafeLoader):
    """SafeLoader that turns every hyperpyyaml-style tag into a TaggedNode instead of failing."""


def _construct_tagged(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> TaggedNode:
    kind, separator, target = node.tag.partition(":")
    if isinstance(node, yaml.MappingNode):
        value: Any = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_scalar(node)
    return TaggedNode(tag=kind + separator, target=target, value=value)


_FlowYamlLoader.add_multi_constructor("!", _construct_tagged)


def parse_flow_yaml(text: str) -> dict[str, Any]:
    """Parse the YAML into plain data with TaggedNode placeholders for tagged values."""
    data = yaml.load(text, Loader=_FlowYamlLoader)  # noqa: S506 - SafeLoader subclass, no arbitrary objects
    if not isinstance(data, dict) or "flow" not in data:
        raise ValueError("flow.yaml has no top-level 'flow' entry")
    return data


def _class_for(target: str) -> type:
    _, found, suffix = target.partition(TAG_PREFIX)
    if not found or suffix not in CLASS_MAP:
        raise ValueError(f"flow.yaml names an unsupported class {target!r}; known: {sorted(CLASS_MAP)}")
    return CLASS_MAP[suffix]


def build(node: Any) -> Any:
    """Instantiate ``!new:`` nodes recursively (children first); plain data passes through."""
    if isinstance(node, TaggedNode):
        if node.tag != "!new:":
            raise ValueError(f"unsupported tag {node.tag}{node.target} inside the flow definition")
        kwargs = node.value or {}
        if not isinstance(kwargs, dict):
            raise ValueError(f"{node.target}: only keyword arguments are supported")
        return _class_for(node.target)(**{key: build(value) for key, value in kwargs.items()})
    if isinstance(node, dict):
        return {key: build(value) for key, value in node.items()}
    if isinstance(node, list):
        return [build(value) for value in node]
    return node


def build_flow_from_yaml(text: str) -> CausalMaskedDiffWithXvec:
    flow = build(parse_flow_yaml(text)["flow"])
    if not isinstance(flow, CausalMaskedDiffWithXvec):
        raise ValueError("flow.yaml's 'flow' entry is not a CausalMaskedDiffWithXvec")
    return flow


def load_flow(path: str | Path) -> CausalMaskedDiffWithXvec:
    """Build an (unweighted) flow module from a flow.yaml file."""
    return build_flow_from_yaml(Path(path).read_text(encoding="utf-8"))


def flow_yaml_text(flow: dict[str, Any], encoder: dict[str, Any], decoder: dict[str, Any], estimator: dict[str, Any]) -> str:
    """Write a flow.yaml in the published shape (same tags and nesting) from four keyword dicts."""

    def block(kwargs: dict[str, Any], indent: int) -> list[str]:
        pad = " " * indent
        return [f"{pad}{key}: {_yaml_scalar(value)}" for key, value in kwargs.items()]

    lines = ["flow: !new:cosyvoice2.flow.flow.CausalMaskedDiffWithXvec", *block(flow, 4),
             "    encoder: !new:cosyvoice2.transformer.upsample_encoder_v2.UpsampleConformerEncoderV2",
             *block(encoder, 8),
             "    decoder: !new:cosyvoice2.flow.flow_matching.CausalConditionalCFM",
             *block(decoder, 8),
             "        estimator: !new:cosyvoice2.flow.decoder_dit.DiT",
             *block(estimator, 12)]
    return "\n".join(lines) + "\n"


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
