#!/usr/bin/env bash
# One-shot model preparation for compose (service `prepare`) and Kubernetes (init Job).
#
# Idempotent: each step checks for its result first, so re-running it is cheap. Steps:
#   1. the CosyVoice2 speech-token LLM in Hugging Face Qwen2 format -> $MODELS_DIR/llm
#      (trtllm-serve's PyTorch backend serves that folder as is: no engine build, no conversion);
#   2. the Step-Audio-2-mini `token2wav` folder -> $MODELS_DIR/token2wav;
#   3. trtllm-serve's extra options (backends/llm/trtllm/llm.yaml with this deployment's values)
#      -> $MODELS_DIR/llm.yaml;
#   4. the built-in voices -> $VOICES_DIR (kept if present: uploads live there too).
set -euo pipefail

: "${MODELS_DIR:=/models}"
: "${VOICES_DIR:=$MODELS_DIR/voices}"
: "${MODEL_SOURCE:=huggingface}"
: "${LLM_REPO:=yuekai/cosyvoice2_llm}"
: "${LLM_REVISION:=main}"
: "${TOKEN2WAV_REPO:=stepfun-ai/Step-Audio-2-mini}"
: "${TOKEN2WAV_REVISION:=main}"
: "${LLM_KV_CACHE_FRACTION:=0.4}"
: "${LLM_MAX_BATCH_SIZE:=64}"
export MODELS_DIR VOICES_DIR MODEL_SOURCE LLM_REPO LLM_REVISION TOKEN2WAV_REPO TOKEN2WAV_REVISION

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-python}"

log() { echo "[prepare] $*" >&2; }

mkdir -p "$MODELS_DIR" "$VOICES_DIR"

if [[ -f "$MODELS_DIR/llm/config.json" && -f "$MODELS_DIR/llm/tokenizer.json" ]]; then
  log "LLM present in $MODELS_DIR/llm"
else
  log "downloading the LLM $LLM_REPO@$LLM_REVISION from $MODEL_SOURCE"
  "$PYTHON" "$here/download.py" llm --repo "$LLM_REPO" --revision "$LLM_REVISION" --out "$MODELS_DIR/llm"
fi

if [[ -f "$MODELS_DIR/token2wav/flow.pt" && -f "$MODELS_DIR/token2wav/hift.pt" ]]; then
  log "token2wav present in $MODELS_DIR/token2wav"
else
  log "downloading token2wav from $TOKEN2WAV_REPO@$TOKEN2WAV_REVISION ($MODEL_SOURCE)"
  "$PYTHON" "$here/download.py" token2wav --repo "$TOKEN2WAV_REPO" --revision "$TOKEN2WAV_REVISION" \
    --out "$MODELS_DIR/token2wav"
fi

log "writing $MODELS_DIR/llm.yaml (KV fraction $LLM_KV_CACHE_FRACTION, batch $LLM_MAX_BATCH_SIZE)"
"$PYTHON" "$here/llm_options.py" "$root/backends/llm/trtllm/llm.yaml" "$MODELS_DIR/llm.yaml" \
  --kv-cache-fraction "$LLM_KV_CACHE_FRACTION" --max-batch-size "$LLM_MAX_BATCH_SIZE"

if compgen -G "$VOICES_DIR/*.npz" > /dev/null; then
  log "voices present in $VOICES_DIR"
else
  log "writing the built-in voices to $VOICES_DIR"
  "$PYTHON" -m backends.voices.presets "$VOICES_DIR"
fi
if [[ -n "${VOICES_UID:-}" && "$(id -u)" == 0 ]]; then
  chown -R "$VOICES_UID" "$VOICES_DIR"  # the gateway (non-root) saves uploaded voices there
fi
date -u +%Y-%m-%dT%H:%M:%SZ > "$MODELS_DIR/.prepared"  # Kubernetes init containers wait for this
log "done"
