"""Triton python-backend adapter for token2wav: decode tensors, call the service, encode the answer.

All logic (sequence table, reaper, limits, voice cache, validation) is in
``backends.token2wav.service`` so it is testable without Triton; keep this file thin.
The stub must run in the project's virtualenv (numpy<2): ``backends.serving.triton`` arranges it.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.token2wav.service import (
    BadRequest,
    ChunkRequest,
    ServiceConfig,
    Token2WavService,
    Token2WavServiceError,
    VoiceTensors,
)

_ERROR_CODES = {
    "bad_request": "INVALID_ARG",
    "unavailable": "UNAVAILABLE",
    "cancelled": "CANCELLED",
    "internal": "INTERNAL",
}


def _require_numpy_1() -> None:
    """Refuse to load under numpy 2: Triton 2.51's stub then hands the model corrupt tensors, silently.

    (Measured: INT32 [1,2,3] arrived as [1,1,1]; a BYTES tensor's length prefix read as garbage.)
    Failing the load names the problem; serving wrong audio would not.
    """
    if int(np.__version__.split(".")[0]) >= 2:
        raise RuntimeError(f"token2wav_dit needs numpy<2 in the Triton stub's environment, found numpy "
                           f"{np.__version__} at {np.__file__} (see backends/serving/triton.py)")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from backends.token2wav.engine import Token2WavEngine  # heavy (torch): only inside the server

        _require_numpy_1()

        model_config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        self.config = ServiceConfig.from_parameters(parameters)
        engine = Token2WavEngine.load(self.config.model_dir, device=_instance_device(self.config.device, args),
                                      dtype=self.config.dtype, cuda_graphs=bool(self.config.cuda_graphs),
                                      graph_mib=self.config.graph_mib, encoder_graph_mib=self.config.encoder_graph_mib,
                                      compile_fused=bool(self.config.compile_fused))
        # Streams per engine call: as many as Triton batches per execute (the worker may hold more).
        engine.max_batch_rows = max(1, int(model_config.get("max_batch_size", 1)))
        engine.calm_batch_rows = max(1, self.config.calm_batch_rows)
        engine.calm_slack_s = self.config.calm_slack_ms / 1000
        engine.deadline_lookahead = bool(self.config.deadline_lookahead)
        if self.config.trace_calls:  # stderr: the worker thread must not wait on Triton's log channel
            engine.on_call = lambda record: print("token2wav " + record.line(), file=sys.stderr, flush=True)
        self.service = Token2WavService(engine, self.config)
        warmed = self.service.warm_up(max_rows=engine.max_batch_rows)
        if warmed:
            pb_utils.Logger.log_info(f"token2wav_dit: CUDA graphs captured in {warmed} warm-up calls: "
                                     f"{engine.graph_summary()}")
        self.service.start_reaper()
        self.service.start_worker()
        pb_utils.Logger.log_info(f"token2wav_dit ready: {self.config}")

    def execute(self, requests: list) -> None:
        """Hand a batch of requests (the sequence batcher gives at most one per stream) to the
        service's worker thread and return at once.

        Each request is answered through its response sender (exactly one final response each, as
        Triton allows for non-decoupled models since 24.07) when its own result is ready. Returning at
        once lets Triton pass the next requests on while the engine works: a stream's first chunk then
        joins the worker's next engine call instead of waiting for this batch's long chunks. A
        cancelled request frees its stream instead.
        """
        senders = [request.get_response_sender() for request in requests]
        decoded: list[tuple[int, int, ChunkRequest]] = []
        for index, request in enumerate(requests):
            cid = int(_input(request, "CORRID").reshape(-1)[0])
            try:
                if request.is_cancelled():
                    self._cancelled(cid)
                    _send(senders[index], _error("cancelled", f"[token2wav:cancelled] request of sequence {cid} was cancelled"))
                    continue
                decoded.append((index, cid, _decode(request, cid)))
            except Token2WavServiceError as exc:
                self.service.cancel(cid)
                _send(senders[index], _error(exc.kind, str(exc)))

        def on_result(position: int, result) -> None:
            index, cid, _ = decoded[position]
            try:
                response = self._respond(requests[index], cid, result)
            except Exception as exc:  # noqa: BLE001 - a response is owed whatever happens
                response = _error("internal", f"[token2wav:internal] {type(exc).__name__}: {exc}")
            _send(senders[index], response)

        self.service.submit([chunk for _, _, chunk in decoded], on_result)
        return None

    def finalize(self) -> None:
        self.service.close()

    def _cancelled(self, cid: int) -> None:
        if self.service.cancel(cid):
            pb_utils.Logger.log_info(f"sequence {cid}: the client cancelled a request; stream freed")

    def _respond(self, request, cid: int, result) -> "pb_utils.InferenceResponse":
        if isinstance(result, Token2WavServiceError):
            return _error(result.kind, str(result))
        if isinstance(result, Exception):
            self.service.cancel(cid)
            return _error("internal", f"[token2wav:internal] {type(result).__name__}: {result}")
        if request.is_cancelled():  # the answer is discarded: free the stream now
            self._cancelled(cid)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("pcm", result.pcm.reshape(1, -1)),
            pb_utils.Tensor("live_sequences", np.array([result.live_sequences], np.int32)),
        ])


def _send(sender, response: "pb_utils.InferenceResponse") -> None:
    """Send a request's one and final response; a client that went away is not an error here."""
    try:
        sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    except Exception as exc:  # noqa: BLE001 - e.g. the request was cancelled meanwhile
        pb_utils.Logger.log_warn(f"token2wav_dit: could not send a response: {exc}")


def _instance_device(device: str, args: dict) -> str:
    """``cuda`` on a KIND_GPU instance means that instance's GPU (one instance per GPU in a group)."""
    if device == "cuda" and args.get("model_instance_kind") == "GPU":
        return f"cuda:{args['model_instance_device_id']}"
    return device


def _input(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _flag(request, name: str) -> bool:
    value = _input(request, name)
    return bool(value is not None and value.size and value.reshape(-1)[0])


def _text(request, name: str) -> str | None:
    value = _input(request, name)
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return item.decode() if isinstance(item, bytes) else str(item)


def _decode(request, cid: int) -> ChunkRequest:
    tokens = _input(request, "tokens")
    prompt_tokens = _input(request, "prompt_tokens")
    voice = None
    if prompt_tokens is not None:
        voice = VoiceTensors(
            prompt_tokens=prompt_tokens,
            prompt_mel=_required(request, "prompt_mel"),
            speaker_embedding=_required(request, "speaker_embedding"),
            lookahead_pad=_text(request, "lookahead_pad") or "silence",
        )
    seed = _input(request, "seed")
    return ChunkRequest(
        correlation_id=cid,
        start=_flag(request, "START"),
        end=_flag(request, "END"),
        tokens=np.zeros(0, np.int32) if tokens is None else tokens,
        abort=_flag(request, "abort"),
        voice_id=_text(request, "voice_id"),
        voice=voice,
        seed=0 if seed is None or seed.size == 0 else int(seed.reshape(-1)[0]),
    )


def _required(request, name: str) -> np.ndarray:
    value = _input(request, name)
    if value is None:
        raise BadRequest(f"{name} is required when prompt_tokens is sent")
    return value


def _error(kind: str, message: str) -> "pb_utils.InferenceResponse":
    code = getattr(pb_utils.TritonError, _ERROR_CODES.get(kind, "INTERNAL"), None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
