#!/usr/bin/env bash
# One command for a GPU machine (budget: under 9 minutes on one H100), run from the project root:
#
#     bash benchmarks/gpu_suite.sh
#
# 1. versions (GPU, driver, torch, triton, CUDA, cuDNN), and the device slug the results are named by;
# 2. the GPU tests: `pytest -m gpu` and tests/test_triton_attention.py on the device (pinned configs);
# 3. the attention sweep (benchmarks/bench_attention.py: every backend, constant / per-head / learned
#    slopes, ViT-B at 224/518/1022/2072 px, fwd and fwd+bwd, correctness-checked before timing), with
#    FlexAttention in a second command (its max-autotune compiles are slow);
# 4. the static SASS proxy with the Triton the machine runs.
# Results: benchmarks/results/attention_<device>.{json,md}, attention_flex_<device>.{json,md},
# kernel_sass_sm90_triton<version>.{json,md} and gpu_suite_<device>.log. Each step has its own time
# limit (SUITE_LIMIT_* seconds; the defaults sum to 490 s) so one slow step cannot eat the budget; a failing step is reported and
# the suite goes on. Commit what it writes.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
DEVICE=$($PY -c "import sys; sys.path.insert(0, 'benchmarks'); import torch; from report import slug; print(slug(torch.cuda.get_device_name()))") || {
  echo "gpu_suite.sh: no CUDA device"; exit 1; }
RESULTS=benchmarks/results
LOG=$RESULTS/gpu_suite_$DEVICE.log
mkdir -p "$RESULTS"
: > "$LOG"
status=0
step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

step versions 20 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; \
  $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", \
  torch.backends.cudnn.version(), \"triton\", triton.__version__, \"device\", torch.cuda.get_device_name())'"
step gpu-tests "${SUITE_LIMIT_TESTS:-120}" env ALIBI_TRITON_AUTOTUNE=0 $PY -m pytest -q -x -m gpu tests/
step triton-tests "${SUITE_LIMIT_TRITON_TESTS:-80}" env ALIBI_TRITON_AUTOTUNE=0 $PY -m pytest -q -x tests/test_triton_attention.py
step sweep "${SUITE_LIMIT_SWEEP:-150}" $PY benchmarks/bench_attention.py --models vit-b --repeats 3 --rep 50 \
  --backends triton triton-atomic-dq triton-nobias sdpa-bias sdpa-nobias sdpa-nobias-flash sdpa-nobias-cudnn \
  sdpa-nobias-efficient sdpa-bias-cudnn sdpa-bias-efficient
step flex "${SUITE_LIMIT_FLEX:-80}" $PY benchmarks/bench_attention.py --models vit-b --sizes 518 1022 --repeats 3 \
  --rep 50 --slopes constant --backends triton flex flex-flash flex-nobias --out-dir "$RESULTS/flex"
if [ -f "$RESULTS/flex/attention_$DEVICE.json" ]; then
  mv "$RESULTS/flex/attention_$DEVICE.json" "$RESULTS/attention_flex_$DEVICE.json"
  mv "$RESULTS/flex/attention_$DEVICE.md" "$RESULTS/attention_flex_$DEVICE.md"
  rmdir "$RESULTS/flex" 2>/dev/null
fi
step sass 40 $PY benchmarks/bench_kernel_sass.py --head-dims 64 --dtypes bfloat16 --default-only
echo "gpu_suite.sh: done in ${SECONDS}s, results in $RESULTS/*_$DEVICE.{json,md}, log $LOG" | tee -a "$LOG"
exit $status
