"""Tiny stand-ins for ``speech_tokenizer_v2_25hz.onnx`` and ``campplus.onnx`` with the real signatures.

For tests and the local stack (whose random-weight token2wav has no encoder files): the inputs
and outputs have the real positions, dtypes and ranks, the maths is a few cheap ops (a time
mean and a random projection; a mel-band mean sampled every 4th frame, i.e. 25 Hz from 100 Hz,
mapped to token ids), so voice creation runs end to end in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backends.voices.encoder import CAMPPLUS_FILE, TOKENIZER_FILE


def _save(graph, path: Path) -> None:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tiny-voice-encoder")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def write_tiny_tokenizer(path: str | Path, seed: int = 0) -> None:
    """feats float32 [1, 128, T], feats_length int32 [1] → speech tokens int64 [1, ceil(T / 4)]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((1, 128, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["feats", "w"], ["weighted"]),
        helper.make_node("ReduceMean", ["weighted"], ["per_frame"], axes=[1], keepdims=0),  # [1, T]
        helper.make_node("Slice", ["per_frame", "starts", "ends", "axes", "steps"], ["sampled"]),
        helper.make_node("Mul", ["sampled", "scale"], ["scaled"]),
        helper.make_node("Abs", ["scaled"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["as_int"], to=TensorProto.INT64),
        helper.make_node("Mod", ["as_int", "vocab"], ["tokens"]),
        helper.make_node("Cast", ["feats_length"], ["length_unused"], to=TensorProto.INT64),
    ]
    init = [
        numpy_helper.from_array(weights, "w"),
        numpy_helper.from_array(np.array([0], np.int64), "starts"),
        numpy_helper.from_array(np.array([2**62], np.int64), "ends"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
        numpy_helper.from_array(np.array([4], np.int64), "steps"),
        numpy_helper.from_array(np.array(4099.0, np.float32), "scale"),
        numpy_helper.from_array(np.array(6561, np.int64), "vocab"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_speech_tokenizer",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "T4"])],
        init,
    )
    _save(graph, Path(path))


def write_tiny_campplus(path: str | Path, seed: int = 0) -> None:
    """fbank float32 [1, T, 80] → embedding float32 [1, 192]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed + 1)
    proj = (rng.standard_normal((80, 192)) / np.sqrt(80)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[1], keepdims=0),  # [1, 80]
        helper.make_node("ReduceMean", ["input"], ["spread_in"], axes=[1], keepdims=1),
        helper.make_node("Sub", ["input", "spread_in"], ["centred"]),
        helper.make_node("Abs", ["centred"], ["dev"]),
        helper.make_node("ReduceMean", ["dev"], ["spread"], axes=[1], keepdims=0),  # [1, 80]
        helper.make_node("Add", ["pooled", "spread"], ["stats"]),
        helper.make_node("MatMul", ["stats", "proj"], ["projected"]),
        helper.make_node("Tanh", ["projected"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        [numpy_helper.from_array(proj, "proj")],
    )
    _save(graph, Path(path))


def write_tiny_encoder_models(model_dir: str | Path, seed: int = 0) -> Path:
    """Both files into ``model_dir`` (created); returns it."""
    model_dir = Path(model_dir)
    write_tiny_tokenizer(model_dir / TOKENIZER_FILE, seed)
    write_tiny_campplus(model_dir / CAMPPLUS_FILE, seed)
    return model_dir
