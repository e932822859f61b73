#!/usr/bin/env bash
# On a machine with a CUDA GPU, in one call: the tests on cuda, then the benchmark in
# bfloat16 with --compile (torch.compile + CUDA graphs), so its numbers can go into BENCHMARKS.md.
#
#   benchmarks/gpu_check.sh [OUT_DIR [BENCH OPTIONS...]]   (default OUT_DIR: benchmarks/gpu-results)
#
# Needs the default model in the weights dir (minillm download; MINILLM_WEIGHTS to point
# elsewhere) and transformers for the comparison. Writes OUT_DIR/{env.txt, tests.txt,
# calibrate.txt, bench.txt, bench.json, bench.md, bench.png, serving.txt, serving.json, serving_*.png,
# quantized.txt, tensor_parallel.txt}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-benchmarks/gpu-results}"
if [ $# -gt 0 ]; then shift; fi  # the rest goes to `minillm bench` (e.g. --quick, --repeats 5)
mkdir -p "$OUT"
PY="${PYTHON:-python}"

"$PY" - <<'PY' | tee "$OUT/env.txt"
import platform, torch
assert torch.cuda.is_available(), "no CUDA GPU visible: run this on a GPU machine"
print("gpu:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| python", platform.python_version())
PY

echo "== tests on cuda" | tee "$OUT/tests.txt"
"$PY" -m pytest tests/test_cuda.py tests/fast/test_compile.py tests/bench/test_bench.py -q -p no:cacheprovider 2>&1 | tee -a "$OUT/tests.txt"

echo "== calibrate cuda bfloat16" | tee "$OUT/calibrate.txt"
"$PY" -m minillm calibrate --device cuda --dtype bfloat16 2>&1 | tee -a "$OUT/calibrate.txt"

echo "== bench cuda bfloat16 --compile" | tee "$OUT/bench.txt"
COLUMNS=200 "$PY" -m minillm bench --device cuda --dtype bfloat16 --compile \
    --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT/bench.png" "$@" 2>&1 | tee -a "$OUT/bench.txt"

echo "== bench-serving cuda (for BENCHMARKS.md's GPU section)" | tee "$OUT/serving.txt"
COLUMNS=200 "$PY" -m minillm bench-serving --device cuda --request-rate 4 16 inf --json "$OUT/serving.json" --plots "$OUT" 2>&1 | tee -a "$OUT/serving.txt"

echo "== quantised decode cuda: bfloat16 vs int8 vs int4, CUDA graphs (for BENCHMARKS.md's GPU section)" | tee "$OUT/quantized.txt"
"$PY" benchmarks/quantized_decode.py --device cuda --compile 2>&1 | tee -a "$OUT/quantized.txt"

echo "== tensor parallelism over NCCL: TP=2 vs one GPU (for BENCHMARKS.md's GPU section; skipped with one GPU)" | tee "$OUT/tensor_parallel.txt"
"$PY" benchmarks/tensor_parallel.py --device cuda 2>&1 | grep -v '^W[0-9]' | tee -a "$OUT/tensor_parallel.txt"
