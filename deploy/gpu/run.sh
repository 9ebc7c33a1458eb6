#!/usr/bin/env bash
# On the GPU benchmark machine (no registry): unpack the slim tritonserver and the wheels carried in
# .gpu/ (made by deploy/gpu/pack.sh), then run the given python module with them on the path.
#   bash deploy/gpu/run.sh deploy.gpu.triton_gpu --probe
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=/tmp/site
if [ ! -x "$SITE/pytriton/tritonserver/bin/tritonserver" ]; then
    mkdir -p "$SITE"
    tar -xJf .gpu/tritonserver.tar.xz -C "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
exec python3 -m "$@"
