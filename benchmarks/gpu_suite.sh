#!/usr/bin/env bash
# The GPU measurements in phases that each fit one command on a lent GPU machine (under 9 minutes cold,
# results under $OUT): run from the project root, one phase per command, in this order:
#
#     bash benchmarks/gpu_suite.sh env
#     bash benchmarks/gpu_suite.sh tests
#     bash benchmarks/gpu_suite.sh fair           # the default and every fair baseline at 518 and 1022 px
#     bash benchmarks/gpu_suite.sh auto           # auto's choices against each candidate, 224-2072 px
#     bash benchmarks/gpu_suite.sh learned-ab     # each backward kernel per slope kind (+ ncu where present)
#     bash benchmarks/gpu_suite.sh model          # whole ViTs forward: ALiBi on every attention path vs DINOv2
#     bash benchmarks/gpu_suite.sh train          # one distillation step per student attention path
#     bash benchmarks/gpu_suite.sh seg            # segment train/apply and the app's Train with ViT features
#     bash benchmarks/gpu_suite.sh sweep-518      # then sweep-1022, sweep-2072
#     bash benchmarks/gpu_suite.sh flex           # then flex-1022, flex-learned, flex-dense, flex-dense-1022
#     bash benchmarks/gpu_suite.sh configs        # autotuned launch configs at 518 and 1022 px
#     bash benchmarks/gpu_suite.sh sqrt-offsets   # the sqrt path's offsets in int32 vs fp16 halves
#     bash benchmarks/gpu_suite.sh fa3            # the FA3-structured Gluon kernel: checked, then timed
#     bash benchmarks/gpu_suite.sh measure        # segment measure's tortuosity (TauFactor) on the GPU vs direct
#     bash benchmarks/gpu_suite.sh sass
#     bash benchmarks/gpu_suite.sh all            # every phase, on a machine without a time limit
#     bash benchmarks/gpu_suite.sh --smoke PHASE  # a CPU dry run of a phase (interpreter, tiny shapes)
#
# Results go to $OUT when it is set, else benchmarks/results/ (smoke runs: benchmarks/results/smoke/).
# What each phase does and writes: benchmarks/gpu_suite.py. PYTHON picks the interpreter (default python3).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu_suite.py "$@"
