#!/usr/bin/env bash
# Start tritonserver on model_repo_dit with a GPU instance group taken from the environment.
#
# config.pbtxt ships the local stack's CPU instance group; Triton has no environment override for it,
# so a writable copy of the repository gets `{ count: $TOKEN2WAV_INSTANCES kind: $TOKEN2WAV_INSTANCE_KIND }`.
# Model parameters (device, dtype, limits) need no rewrite: the model reads TOKEN2WAV_<KEY> itself.
# Extra arguments are passed to tritonserver.
set -euo pipefail

: "${TOKEN2WAV_INSTANCES:=1}"
: "${TOKEN2WAV_INSTANCE_KIND:=KIND_GPU}"
: "${TRITON_MODEL_REPO_SRC:=/opt/cosyvoice/model_repo_dit}"
: "${TRITON_MODEL_REPO:=/tmp/model_repo_dit}"

if ! [[ "$TOKEN2WAV_INSTANCES" =~ ^[1-9][0-9]*$ ]]; then
  echo "TOKEN2WAV_INSTANCES must be a positive integer, got '$TOKEN2WAV_INSTANCES'" >&2
  exit 2
fi
case "$TOKEN2WAV_INSTANCE_KIND" in
  KIND_GPU|KIND_CPU) ;;
  *) echo "TOKEN2WAV_INSTANCE_KIND must be KIND_GPU or KIND_CPU, got '$TOKEN2WAV_INSTANCE_KIND'" >&2; exit 2 ;;
esac

rm -rf "$TRITON_MODEL_REPO"
cp -r "$TRITON_MODEL_REPO_SRC" "$TRITON_MODEL_REPO"
config="$TRITON_MODEL_REPO/token2wav_dit/config.pbtxt"
sed -i -E "s/^instance_group \[.*\]$/instance_group [ { count: ${TOKEN2WAV_INSTANCES} kind: ${TOKEN2WAV_INSTANCE_KIND} } ]/" "$config"
grep -q "count: ${TOKEN2WAV_INSTANCES} kind: ${TOKEN2WAV_INSTANCE_KIND}" "$config" || {
  echo "could not set the instance group in $config" >&2
  exit 1
}

exec tritonserver \
  --model-repository="$TRITON_MODEL_REPO" \
  --http-port=8000 --grpc-port=8001 --metrics-port=8002 \
  --allow-metrics=true --strict-readiness=true --exit-timeout-secs=30 \
  "$@"
