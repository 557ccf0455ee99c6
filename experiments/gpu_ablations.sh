#!/bin/bash
# The GPU ablations (fig7, table6, table7, table8) on the GPUs of one machine, as
# committed under results/*_gpu/:
#
#     bash experiments/gpu_ablations.sh [WORKDIR] [STEPS] [TIME_LIMIT_S] [SEEDS] [RUNS] [LRS]
#
# STEPS training steps per run [2000]; SEEDS: training seeds, space-separated ["0"],
# e.g. "0 1 2" (single runs cannot rank these variants: see results/gpu_repeat/);
# RUNS: space-separated sweep:run names of any configs/<sweep>.py, e.g.
# fig9:zero_dense_d64, or sweep:* for all of a sweep's runs ["" = every run of fig7,
# table6, table7 and table8, the tables' base runs once]; LRS: the learning rates, a
# Python tuple ["(0.003,)", the SPEC section 5 calibration's; the configs' own default
# is "(0.001, 0.003)"].
#
# Seeds are trained in waves (seed 0 of every run, then seed 1, ...), so a TIME_LIMIT_S
# [no limit] that cuts the job short leaves whole seeds finished rather than every run
# half done. Within a wave the runs are spread over the machine's GPUs (those
# CUDA_VISIBLE_DEVICES lists, if set), the cheapest total per GPU by the train-step
# times below, and all runs of one GPU train side by side, one process each.
#
# The base SSE run (N=4, k=1, softmax keys, gate "both", shared QKV) and the GLA run are
# the same configuration in several sweeps: trained once in fig7 and copied to the
# others. Reports go to WORKDIR/results/<sweep>/ (mean and spread over the seeds that
# finished; runs stopped by the time limit appear as unfinished, with their last
# evaluation). Calling it again with the same WORKDIR skips the finished runs, so a
# sweep can be split over several calls with RUNS. The configs' full size:
#
#     bash experiments/gpu_ablations.sh workdir_full 4000 0 "0 1 2" "" "(0.001, 0.003)"
#
# (a WORKDIR of its own: the runner refuses finished runs of another length).
#
# EXTRA (environment): more flags for every `experiments.ablation` call, e.g.
# EXTRA="--config.train.batch_size=8" for a quick trial of the script itself.
#
# STACK=1 (environment) trains each run's learning rates and seeds together as one
# vmapped program (`ablation --stack`): one process per run instead of one per (lr,
# seed), all seeds in one wave; runs of one seed share their data. On the H200 a stacked
# group is bounded by its one host thread making one MQAR batch per seed per step (~18
# ms each): 3 seeds of N4_k1 made 18-19 steps/s, one run alone 53 (see
# results/gpu_long_probe/README.md). EXTRA="--config.train.data_workers=4" makes each
# stream's batches in 4 worker processes instead (the same batches): on the H200 machine
# (16 cores) N4_k1 went from 13 to 87 steps/s with 3 seeds stacked, and from 55 to 193
# alone (results/gpu_long_probe/README.md); the GPU is then the bound.
set -u
cd "$(dirname "$0")/.."
W=${1:-workdir}; STEPS=${2:-2000}; LIMIT=${3:-0}; SEEDS=${4:-0}; LRS=${6:-"(0.003,)"}
ALL="fig7:N1_k1 fig7:N2_k1 fig7:N4_k1 fig7:N4_k2 fig7:N8_k2 fig7:N8_k4 fig7:N16_k4
     fig7:N16_k8 fig7:N32_k8 fig7:N32_k16 fig7:GLA fig7:Transformer table6:silu
     table6:identity table7:none table7:write table7:read table8:separate"
RUNS=${5:-$ALL}
# sweep:* is every run of that sweep.
set -f  # no globbing while RUNS may hold sweep:*
for r in $RUNS; do
  [ -f "configs/${r%%:*}.py" ] || { echo "RUNS: $r: no config configs/${r%%:*}.py" >&2; exit 2; }
done
RUNS=$(for r in $RUNS; do
  if [ "${r#*:}" = "*" ]; then
    python3 -c "from configs import ${r%%:*} as m; print(' '.join('${r%%:*}:' + x['name'] for x in m.get_config().runs))"
  else echo "$r"; fi
done)
SWEEPS=$(for r in $RUNS; do echo "${r%%:*}"; done | awk '!seen[$0]++' | tr '\n' ' ')
set +f
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Train step alone on the H200, ms (2 layers, width 128, B = 128, T = 128, bf16; the
# N = 2, 8, 16 values are interpolated): only used to balance the GPUs.
declare -A COST=([N1_k1]=5 [N2_k1]=6 [N4_k1]=6 [N4_k2]=7 [N8_k2]=10 [N8_k4]=10
                 [N16_k4]=18 [N16_k8]=18 [N32_k8]=34 [N32_k16]=34 [GLA]=3
                 [Transformer]=3 [separate]=8)
# The GPUs to use: those CUDA_VISIBLE_DEVICES names if it is set, else all.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a DEVICES <<< "$CUDA_VISIBLE_DEVICES"
else
  n=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU") || n=1
  DEVICES=($(seq 0 $((n > 0 ? n - 1 : 0))))
fi
NGPU=${#DEVICES[@]}
# Cheapest-GPU-first assignment of the runs, most expensive run first.
declare -a LOAD GROUP
for ((g = 0; g < NGPU; g++)); do LOAD[g]=0; GROUP[g]=""; done
for r in $(for r in $RUNS; do echo "${COST[${r#*:}]:-6} $r"; done | sort -rn | cut -d' ' -f2); do
  best=0
  for ((g = 1; g < NGPU; g++)); do ((LOAD[g] < LOAD[best])) && best=$g; done
  LOAD[best]=$((LOAD[best] + ${COST[${r#*:}]:-6})); GROUP[best]="${GROUP[best]} $r"
done
# Every learning rate of a run trains at once too.
NLR=$(python3 -c "l = $LRS; assert isinstance(l, tuple) and l; print(len(l))" 2>/dev/null) ||
  { echo "LRS=$LRS: expected a non-empty Python tuple such as \"(0.003,)\"" >&2; exit 2; }
STACK=${STACK:-0}
PER_RUN=$NLR  # processes per run
if [ "$STACK" = 1 ]; then PER_RUN=1; fi
maxn=1
for ((g = 0; g < NGPU; g++)); do
  n=$(($(echo ${GROUP[g]} | wc -w) * PER_RUN)); ((n > maxn)) && maxn=$n
  echo "GPU ${DEVICES[g]}: ${GROUP[g]} (${LOAD[g]} ms per step)"
done
# Share each GPU's memory among its processes.
export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(min(0.5, 0.9 / $maxn), 3))")
C=(--workdir="$W" --config.train.num_steps="$STEPS" "--config.lrs=$LRS" ${EXTRA:-})
seeds="($(echo $SEEDS | sed 's/ /, /g'),)"
WAVES=$SEEDS  # one wave per seed, or with STACK=1 one wave of all seeds
if [ "$STACK" = 1 ]; then C+=(--stack); WAVES=all; fi
mkdir -p "$W/logs"
start=$SECONDS
for s in $WAVES; do
  left=0
  if ((LIMIT > 0)); then
    left=$((LIMIT - (SECONDS - start)))
    if ((left <= 0)); then echo "time limit reached before seed $s"; break; fi
  fi
  echo "== seed $s ($((SECONDS - start)) s)"
  for ((g = 0; g < NGPU; g++)); do
    for sweep in $SWEEPS; do
      only=$(for r in ${GROUP[g]}; do [ "${r%%:*}" = $sweep ] && echo -n "${r#*:},"; done)
      [ -z "$only" ] && continue
      n=$(($(echo "$only" | tr ',' ' ' | wc -w) * PER_RUN))
      wave_seeds="($s,)"; [ "$s" = all ] && wave_seeds=$seeds
      CUDA_VISIBLE_DEVICES=${DEVICES[g]} timeout "$left" python3 -m experiments.ablation \
          --config=configs/$sweep.py "${C[@]}" "--config.seeds=$wave_seeds" --only="${only%,}" \
          --workers="$n" > "$W/logs/${sweep}_gpu${g}_seed$s.log" 2>&1 &
    done
  done
  wait
  grep -h "done" "$W"/logs/*_seed$s.log
done
# fig7's base runs stand in for the tables' (same configuration), where a table has
# not trained its own (e.g. RUNS=table6:*).
for pair in table6:softmax table7:both table8:shared table6:GLA; do
  t=${pair%%:*}; r=${pair##*:}; src=N4_k1; [ "$r" = GLA ] && src=GLA
  [[ " $SWEEPS " == *" $t "* ]] || continue
  for job in "$W/fig7_gpu/$src"/lr*; do
    [ -f "$job/summary.json" ] || continue
    dest="$W/${t}_gpu/$r/$(basename "$job")"
    [ -e "$dest" ] || { mkdir -p "$(dirname "$dest")" && cp -r "$job" "$dest"; }
  done
done
for t in $SWEEPS; do
  python3 -m experiments.ablation --config=configs/$t.py "${C[@]}" "--config.seeds=$seeds" \
      --report_only --results="$W/results/${t}_gpu" > "$W/logs/${t}_report.log" 2>&1 \
      || echo "no report for $t (see $W/logs/${t}_report.log)"
done
