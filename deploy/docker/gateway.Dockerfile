# syntax=docker/dockerfile:1
# The gateway image (target `gateway`, the default last stage is `prepare`: build with --target).
#
#   gateway  python slim + `pip install .`: FastAPI, PyAV (bundles FFmpeg), tritonclient, tokenizers,
#            numpy. No torch: the build fails if anything pulls it in.
#   prepare  gateway + the download clients (huggingface_hub, modelscope) and pyyaml, for the one-shot
#            model preparation (deploy/prepare/prepare.sh).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS gateway
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml ./
COPY gateway ./gateway
COPY backends ./backends
RUN pip install . \
 && python -c "import importlib.util as u, sys; sys.exit('torch must not be in the gateway image' if u.find_spec('torch') else 0)"
RUN useradd --uid 10001 --create-home gateway && mkdir -p /voices && chown gateway /voices
USER 10001
ENV TTS_HOST=0.0.0.0 TTS_PORT=8000 TTS_VOICES_DIR=/voices TTS_SHUTDOWN_DRAIN_S=30
EXPOSE 8000
# SIGTERM: uvicorn drains in-flight responses for TTS_SHUTDOWN_DRAIN_S, then the app's own drain runs
# (README "Graceful shutdown"); the orchestrator's grace period covers both (compose, k8s: 70 s).
CMD ["sh", "-c", "exec uvicorn gateway.app:app --host \"$TTS_HOST\" --port \"$TTS_PORT\" --no-access-log --timeout-graceful-shutdown \"$TTS_SHUTDOWN_DRAIN_S\""]

FROM gateway AS prepare
USER root
ARG HF_HUB_VERSION=0.35.3
RUN pip install "huggingface_hub==${HF_HUB_VERSION}" modelscope pyyaml
COPY deploy/prepare ./deploy/prepare
ENV VOICES_UID=10001
CMD ["bash", "deploy/prepare/prepare.sh"]
