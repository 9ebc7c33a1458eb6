#!/usr/bin/env bash
# Build .gpu/site.tar.xz: what the GPU benchmark machine lacks, installed for its Python 3.12, in one
# archive that deploy/gpu/run.sh unpacks there. That machine has PyTorch, CUDA, grpcio, protobuf,
# httpx, tokenizers, uvloop and numpy 2.x but no registry and no Triton, and a call carries at most
# 64 MiB, so the archive holds only:
#   - the tritonserver binary, the python backend, the Python 3.12 stub and the libraries they load,
#     from the nvidia-pytriton wheel (its bundled libpython3.13 and the other stubs are left out);
#   - numpy 1.26 (Triton 2.51's stub corrupts tensors under numpy 2: ARCHITECTURE.md), tritonclient
#     without its perf_analyzer binaries, python-rapidjson, and the gateway's pure-Python needs
#     (pydantic, pydantic-settings, fastapi, starlette, uvicorn, prometheus-client) and aiohttp (the LLM
#     client) for the pipeline benchmark and the replayer; for the http benchmark (the gateway under
#     uvicorn, driven by the OpenAI SDK) the SDK and what it needs beyond the image (anyio, httpx2, ...).
#     No PyAV (FFmpeg would not fit): the gateway serves pcm and wav without it.
#
#   bash deploy/gpu/pack.sh          # then carry .gpu in a device run
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.gpu
site="$out/site"
rm -rf "$site"

platforms=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
wheels=(
    nvidia-pytriton==0.7.0 numpy==1.26.4 tritonclient==2.51.0 python-rapidjson==1.25
    pydantic==2.14.3 pydantic-core==2.50.4 pydantic-settings==2.16.3 python-dotenv==1.2.4
    typing-inspection==0.4.5 annotated-types==0.8.0 starlette==1.10.0 uvicorn==0.54.0 fastapi==0.165.0
    opentelemetry-api==1.45.2 typing-extensions==4.16.0
    aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1
    propcache==0.5.4 yarl==1.25.1
    prometheus-client==0.26.0
    openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 anyio==4.16.0 sniffio==1.3.1
    h11==0.16.0 idna==3.20
)
# Installed for the GPU machine's interpreter (cp312), not this one's; each pinned, no resolver.
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --target "$site" "${wheels[@]}"
rm -rf "${site:?}/bin"  # console scripts and tritonclient's perf_analyzer binaries (40 MB): not needed

# Keep only the server pieces that run on Python 3.12.
triton="$site/pytriton/tritonserver"
find "$site/pytriton" -mindepth 1 -maxdepth 1 ! -name tritonserver -exec rm -rf {} +
find "$triton/python_backend_stubs" -mindepth 1 -maxdepth 1 ! -name 3.12 -exec rm -rf {} +
rm -f "$site"/nvidia_pytriton.libs/libpython3-*
rm -rf "$site"/numpy/*/tests "$site"/numpy/tests

tar -C "$site" -cJf "$out/site.tar.xz" .
rm -rf "$site"
ls -l "$out/site.tar.xz"
