#!/bin/bash
# The GPU ablations (fig7, table6, table7, table8) at once on one GPU, as committed under
# results/*_gpu/:
#
#     bash experiments/gpu_ablations.sh [WORKDIR] [STEPS] [TIME_LIMIT_S] [SEEDS]
#
# The four sweeps run side by side (18 training processes: a 2-layer width-128 model
# leaves an H200 mostly idle), with one learning rate (3e-3, the SPEC section 5
# calibration's) and STEPS steps [2000]; each sweep is stopped after TIME_LIMIT_S
# seconds [no limit]; SEEDS is a Python tuple of training seeds ["(0,)"], e.g.
# "(0, 1, 2)" (single runs cannot rank these variants: see results/gpu_repeat/). The
# base SSE run (N=4, k=1, softmax keys, gate "both", shared QKV) and the GLA run are the
# same configuration in several sweeps: trained once in fig7 and copied to the others. Reports go to WORKDIR/results/<sweep>/; runs stopped by the time
# limit appear there as unfinished, with their last evaluation. The full-size configs
# (4000 steps, learning rates 1e-3 and 3e-3) are the configs' defaults: drop the
# overrides in C below to run them.
set -u
cd "$(dirname "$0")/.."
W=${1:-workdir}; STEPS=${2:-2000}; LIMIT=${3:-0}; SEEDS=${4:-"(0,)"}
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
C=(--workdir="$W" --config.train.num_steps="$STEPS" "--config.lrs=(0.003,)" "--config.seeds=$SEEDS")
mkdir -p "$W"
timeout "$LIMIT" python3 -m experiments.ablation --config=configs/fig7.py "${C[@]}" --workers=12 > "$W/fig7.log" 2>&1 &
timeout "$LIMIT" python3 -m experiments.ablation --config=configs/table6.py "${C[@]}" --only=silu,identity --workers=2 > "$W/table6.log" 2>&1 &
timeout "$LIMIT" python3 -m experiments.ablation --config=configs/table7.py "${C[@]}" --only=none,write,read --workers=3 > "$W/table7.log" 2>&1 &
timeout "$LIMIT" python3 -m experiments.ablation --config=configs/table8.py "${C[@]}" --only=separate > "$W/table8.log" 2>&1 &
wait
for pair in table6:softmax table7:both table8:shared table6:GLA; do
  t=${pair%%:*}; r=${pair##*:}; src=N4_k1; [ "$r" = GLA ] && src=GLA
  if [ -d "$W/fig7_gpu/$src" ]; then
    mkdir -p "$W/${t}_gpu/$r" && cp -r "$W/fig7_gpu/$src/." "$W/${t}_gpu/$r/"
  fi
done
for t in fig7 table6 table7 table8; do
  python3 -m experiments.ablation --config=configs/$t.py "${C[@]}" --report_only \
      --results="$W/results/${t}_gpu"
done
