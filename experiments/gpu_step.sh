#!/bin/bash
# The GPU measurements of training speed, ours and the PyTorch peers in one session:
#
#     bash experiments/gpu_step.sh [OUT] [STEPS]
#
# STEPS: a comma-separated subset of profile,throughput,peers [profile,throughput,peers].
# SIZE [125m], TOKENS [32768] (tokens per step), LENGTHS [2048,8192,32768] and VARIANTS
# [sse,sse_h,gla,gla_h] override the setting (SIZE=tiny TOKENS=256 LENGTHS=64 is a CPU
# smoke run of the first two steps). On an H100, expect ~1 minute per profiled point
# (state, compile, trace), ~45 s per throughput point, and minutes of Triton autotuning
# before the peers' first timed step.
#
# 1. (profile) `experiments.profile_step`, SSE and GLA at the largest and smallest T:
#    device time per part of the step, file and pass, with each point's optimised HLO in
#    OUT/profile_step/hlo (what XLA fused into a slow fusion);
# 2. (throughput) `experiments.throughput`: tokens/s and peak memory of VARIANTS at
#    LENGTHS, one child process per point;
# 3. (peers) `experiments.bench_fla_e2e`: fla's GLA and the authors' SSEGLA models of the
#    same shape at the same LENGTHS and TOKENS (needs torch, fla 0.6.0 and the authors'
#    layer from fla pull request #882 copied over it).
# Everything lands in OUT [results/step_gpu], with the logs profile_step.log,
# throughput.log and peers.log. Exits non-zero when a step failed.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-results/step_gpu}; STEPS=",${2:-profile,throughput,peers},"
SIZE=${SIZE:-125m}; TOKENS=${TOKENS:-32768}; LENGTHS=${LENGTHS:-2048,8192,32768}
VARIANTS=${VARIANTS:-sse,sse_h,gla,gla_h}
mkdir -p "$OUT"
FAILED=""
if [[ $STEPS == *,profile,* ]]; then
  ends=$(echo "$LENGTHS" | tr ',' '\n' | sort -n | sed -n '1p;$p' | sort -rnu | paste -sd,)
  python3 -m experiments.profile_step --size="$SIZE" --tokens="$TOKENS" --variants=sse,gla \
      --lengths="$ends" --reps=3 --steps=3 --out="$OUT/profile_step" \
      --hlo_dir="$OUT/profile_step/hlo" > "$OUT/profile_step.log" 2>&1 || FAILED="$FAILED profile"
  grep -E "^(profiling|  step )" "$OUT/profile_step.log"
fi
if [[ $STEPS == *,throughput,* ]]; then
  python3 -m experiments.throughput --size="$SIZE" --tokens="$TOKENS" --variants="$VARIANTS" \
      --lengths="$LENGTHS" --steps=5 --warmup=1 --out="$OUT/throughput" \
      > "$OUT/throughput.log" 2>&1 || FAILED="$FAILED throughput"
  grep -sE "^\|" "$OUT/throughput/throughput.md"
fi
if [[ $STEPS == *,peers,* ]]; then
  python3 -m experiments.bench_fla_e2e --size="$SIZE" --tokens="$TOKENS" --variants=gla,sse \
      --lengths="$LENGTHS" --out="$OUT/peers" > "$OUT/peers.log" 2>&1 || FAILED="$FAILED peers"
  grep -E "^\{" "$OUT/peers.log"
fi
if [ -n "$FAILED" ]; then echo "failed:$FAILED (see the logs in $OUT)" >&2; exit 1; fi
