#!/usr/bin/env bash
# On the GPU benchmark machine (no registry): unpack .gpu/site.tar.xz (made by deploy/gpu/pack.sh:
# a slim tritonserver and the few Python packages the image lacks), then run the given python module
# from a virtualenv whose site-packages come first and then the image's.
#
# Why a virtualenv and not PYTHONPATH: Triton's python stub imports from the virtualenv that is active
# when the server starts (backends/serving/triton.py activates sys.prefix) and does not see PYTHONPATH,
# so with the image's numpy 2 it corrupted tensors (measured on an H100, 2026-11-22). The venv's .pth
# puts the archive (numpy 1.26) ahead of the image's site-packages (torch, CUDA).
#   bash deploy/gpu/run.sh deploy.gpu.triton_gpu --probe
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=/tmp/site
VENV=/tmp/stubenv
if [ ! -x "$SITE/pytriton/tritonserver/bin/tritonserver" ]; then
    mkdir -p "$SITE"
    tar -xJf .gpu/site.tar.xz -C "$SITE"
fi
if [ ! -x "$VENV/bin/python3" ]; then
    image_site="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    python3 -m venv --without-pip "$VENV"
    venv_site="$("$VENV/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n%s\n%s\n' "$SITE" "$PWD" "$image_site" > "$venv_site/00-gpu-bench.pth"
fi
export PYTHONUNBUFFERED=1
"$VENV/bin/python3" -c 'import numpy, torch; assert numpy.__version__ < "2", numpy.__file__; print("venv:", numpy.__version__, torch.__version__)'
exec "$VENV/bin/python3" -m "$@"
