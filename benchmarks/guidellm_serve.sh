#!/usr/bin/env bash
# guidellm (vLLM's benchmark tool) against `minillm serve` on the default model, in guidellm's
# default streaming mode, which sends vLLM's stream_options.continuous_usage_stats (issue 31, item 3).
#
#   python3 -m venv /tmp/gvenv && /tmp/gvenv/bin/pip install torch==2.13.0 guidellm   # its own venv
#   GUIDELLM=/tmp/gvenv/bin/guidellm bash benchmarks/guidellm_serve.sh [STREAMS] [REQUESTS]
#
# Starts the server on a free port, runs guidellm's concurrent profile (STREAMS at once, default 4;
# REQUESTS in all, default 16) on synthetic prompts of 128 tokens asking for 32, prints guidellm's
# tables and the machine's load, and stops the server. The tokenizer is read from the local model
# folder: nothing is fetched from the hub.
set -euo pipefail
cd "$(dirname "$0")/.."
GUIDELLM="${GUIDELLM:-guidellm}"
STREAMS="${1:-4}"
REQUESTS="${2:-16}"
PORT="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
MODEL_DIR="$(python -c 'from minillm.formats.weights import resolve_model; print(resolve_model("smollm2-135m-instruct", download=True))')"
OUT="$(mktemp -d)"

minillm serve --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done

echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
HF_HUB_OFFLINE=1 "$GUIDELLM" run \
  --backend "kind=openai_http,target=http://127.0.0.1:$PORT" \
  --profile "kind=concurrent,streams=$STREAMS" \
  --constraint "kind=max_requests,count=$REQUESTS" \
  --data "kind=synthetic_text,prompt_tokens=128,output_tokens=32" \
  --tokenizer "kind=huggingface_auto,model=$MODEL_DIR" \
  --output "kind=json,path=$OUT/benchmarks.json" \
  --disable-progress
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
