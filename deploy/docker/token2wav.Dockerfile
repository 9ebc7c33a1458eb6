# syntax=docker/dockerfile:1
# token2wav on the GPU: NVIDIA's tritonserver image + torch (CUDA) + this project's backends.
#
# numpy<2 is a hard requirement: Triton's python-backend stub silently corrupts tensors when the model's
# environment has numpy 2 (ARCHITECTURE.md, measured). The build checks it.
# The entrypoint copies model_repo_dit to a writable place and sets the instance group from the
# environment (KIND_GPU, TOKEN2WAV_INSTANCES per GPU); TOKEN2WAV_<KEY> overrides any config.pbtxt parameter.
ARG TRITON_VERSION=25.06
FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3
ARG TORCH_VERSION=2.8.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
WORKDIR /opt/cosyvoice
RUN python3 -m pip --version || (apt-get update && apt-get install -y --no-install-recommends python3-pip \
    && rm -rf /var/lib/apt/lists/*)
RUN python3 -m pip install "torch==${TORCH_VERSION}" "numpy<2"
COPY pyproject.toml ./
COPY gateway ./gateway
COPY backends ./backends
RUN python3 -m pip install ".[backends]" "numpy<2" \
 && python3 -c "import numpy, torch; assert numpy.__version__.startswith('1.'), numpy.__version__; print('torch', torch.__version__, 'numpy', numpy.__version__)"
COPY model_repo_dit ./model_repo_dit
COPY deploy/docker/token2wav-entrypoint.sh /usr/local/bin/token2wav-entrypoint
ENV TOKEN2WAV_DEVICE=cuda TOKEN2WAV_DTYPE=bfloat16 TOKEN2WAV_MODEL_DIR=/models/token2wav
EXPOSE 8000 8001 8002
ENTRYPOINT ["bash", "/usr/local/bin/token2wav-entrypoint"]
