#!/bin/bash
# The GPU checks and timings of the Pallas kernels:
#
#     bash experiments/gpu_kernels.sh [OUT] [FLA_TIMEOUT_S] [STEPS]
#
# STEPS: a comma-separated subset of tests,profile,bench,trace,gdn,in_place
# [tests,profile,bench]. On
# an H200 with 16 CPU cores expect roughly 4 minutes for tests (PYTEST_WORKERS [4]
# pytest workers: 45 tests, compile-bound; 8 workers ran 41 in 99 s, and each C = 128
# block-size case compiles for 100-140 s), 3 for
# profile, 6 for bench (~7 s of compiling per row), plus up to FLA_TIMEOUT_S for fla
# (its first call compiles and autotunes for ~4 minutes), and ~1 for trace: split the
# steps over runs where time is limited.
#
# 1. the Pallas GPU test class (outputs, states, every gradient vs the scan), the
#    CUDA lowering checks, and cuDNN attention against XLA's (the GPU models' path);
# 2. `experiments.profile_kernels` at L = 32K: each kernel alone, then BlockSizes
#    variants of the whole core, each compared with the defaults' outputs and
#    gradients (the per-kernel table of docs/kernels.md);
# 3. `experiments.bench_ops` over the Fig. 6 grid with bf16 errors at L = 2048, and fla
#    side by side, stopped after FLA_TIMEOUT_S seconds [400] (its rows so far kept).
# 4. (trace) device time per compiled HLO op of fwd + bwd of the dense op and SSE
#    pallas_varlen (N = 4, 16) at L = 32K, from a profiler trace, with each program's
#    HLO under OUT/hlo: what the packing around the kernels costs, fusion by fusion.
# 5. (gdn) the delta-rule kernels: their GPU test class, then bench_ops' gdn / sse_gdn rows
#    over the Fig. 6 grid with fla's `chunk_gated_delta_rule` and the authors' SSE-GDN op
#    beside them (bench_fla --ops=gdn,sse_gdn), into OUT/gdn (~1 minute of tests on an
#    H100, ~15 s of compiling per Pallas row, plus fla's autotuning).
# 6. (in_place) the packed ops reading their slots in place (BlockSizes.gather_rows): the
#    GPU test cases of that path, then bench_ops at L = 32K, N = 4 for GLA, SSE varlen, GDN
#    and SSE-GDN varlen with the copied buffers and in place, side by side, into
#    OUT/in_place/{copied,in_place} (~3 minutes on an H100).
# Everything lands in OUT [results/bench_ops], with the logs test_pallas.log,
# profile_kernels.log, bench.log and trace.log. Exits non-zero when a step failed.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-results/bench_ops}; FLA_TIMEOUT=${2:-400}; STEPS=",${3:-tests,profile,bench},"
mkdir -p "$OUT"
FAILED=""
if [[ $STEPS == *,tests,* ]]; then
# Several pytest workers share the GPU (compiling dominates): no preallocation.
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -rfE -p no:cacheprovider \
    -n "${PYTEST_WORKERS:-4}" --durations=8 tests/test_pallas.py::TestPallasGPU \
    tests/test_pallas.py::test_kernels_lower_for_cuda \
    tests/test_layers_attention.py::test_cudnn_attention_matches_xla_on_gpu \
    > "$OUT/test_pallas.log" 2>&1 \
    || FAILED="$FAILED tests"
echo "tests: $(tail -n 1 "$OUT/test_pallas.log")"
# The failing cases by name, and how far off they were, where the log may not be read.
grep -E "^(FAILED|ERROR) " "$OUT/test_pallas.log" | cut -c1-400
fi
if [[ $STEPS == *,profile,* ]]; then
python3 -m experiments.profile_kernels --out="$OUT/profile_kernels.json" \
    --variants=diag_unroll=1 --variants=diag_unroll=2 --variants=diag_unroll=16 \
    --variants=num_warps=8 --variants=recompute_states=true \
    --variants=split_dqk=false --variants=split_dqk=false,diag_unroll=1 \
    > "$OUT/profile_kernels.log" 2>&1 || FAILED="$FAILED profile"
grep -E "^(defaults|\{)" "$OUT/profile_kernels.log"
fi
if [[ $STEPS == *,bench,* ]]; then
python3 -m experiments.bench_ops --lengths=32768,8192,2048 --partitions=4,8,16 \
    --gla_impls=chunk,pallas_chunk \
    --sse_impls=pallas_varlen,pallas_masking,varlen,masking,loop --loop_max_length=2048 \
    --check_length=2048 --reps=10 --time_fwd=false --fla_timeout="$FLA_TIMEOUT" \
    --out="$OUT" > "$OUT/bench.log" 2>&1 || FAILED="$FAILED bench"
grep -E "^(gla|sse|fla)" "$OUT/bench.log"
fi
if [[ $STEPS == *,trace,* ]]; then
# Command buffers would fold a program's kernels into one timed op: off, per HLO op.
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
python3 -m experiments.profile_kernels --nokernels --length=32768 --reps=5 \
    --trace_partitions=0,4,16 --hlo_dir="$OUT/hlo" --out="$OUT/trace.json" \
    > "$OUT/trace.log" 2>&1 || FAILED="$FAILED trace"
grep -A12 "^trace" "$OUT/trace.log"
fi
if [[ $STEPS == *,gdn,* ]]; then
mkdir -p "$OUT/gdn"
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -rfE -p no:cacheprovider \
    --durations=8 tests/test_pallas_gdn.py::TestPallasGdnGPU \
    tests/test_pallas_gdn.py::test_kernels_lower_for_cuda \
    tests/test_pallas_gdn.py::test_auto_and_plans_for_the_delta_rule_ops \
    > "$OUT/gdn/test_pallas_gdn.log" 2>&1 || FAILED="$FAILED gdn-tests"
echo "gdn tests: $(tail -n 1 "$OUT/gdn/test_pallas_gdn.log")"
python3 -m experiments.bench_ops --lengths=32768,8192,2048 --partitions=4,8,16 \
    --gla_impls= --sse_impls= --gdn_impls=chunk,pallas_chunk \
    --sse_gdn_impls=pallas_varlen,pallas_masking,varlen --check_length=2048 --reps=10 \
    --time_fwd=false --fla_timeout="$FLA_TIMEOUT" --out="$OUT/gdn" \
    > "$OUT/gdn/bench.log" 2>&1 || FAILED="$FAILED gdn-bench"
grep -E "^(gdn|sse_gdn|fla)" "$OUT/gdn/bench.log"
fi
if [[ $STEPS == *,in_place,* ]]; then
mkdir -p "$OUT/in_place"
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -rfE -p no:cacheprovider \
    -n "${PYTEST_WORKERS:-4}" -k "gather_rows or in_place" \
    tests/test_pallas.py::TestPallasGPU tests/test_pallas_gdn.py::TestPallasGdnGPU \
    > "$OUT/in_place/test.log" 2>&1 || FAILED="$FAILED in_place-tests"
echo "in_place tests: $(tail -n 1 "$OUT/in_place/test.log")"
grep -E "^(FAILED|ERROR) " "$OUT/in_place/test.log" | cut -c1-400
for layout in copied in_place; do
  flag=$([ "$layout" = in_place ] && echo true || echo false)
  python3 -m experiments.bench_ops --lengths=32768 --partitions=4 \
      --gla_impls=pallas_chunk --sse_impls=pallas_varlen --gdn_impls=pallas_chunk \
      --sse_gdn_impls=pallas_varlen --reps=10 --time_fwd=false --fla=false \
      --block_sizes="gather_rows=$flag" --gdn_block_sizes="gather_rows=$flag" \
      --out="$OUT/in_place/$layout" > "$OUT/in_place/$layout.log" 2>&1 \
      || FAILED="$FAILED in_place-$layout"
  echo "$layout:"; grep -E "^(gla|sse|gdn|sse_gdn) " "$OUT/in_place/$layout.log"
done
fi
if [ -n "$FAILED" ]; then echo "failed:$FAILED (see the logs in $OUT)" >&2; exit 1; fi
