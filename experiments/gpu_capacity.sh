#!/bin/bash
# The capacity-bound ablations on one GPU, as committed under results/{fig7,table6,
# table7,table8,fig9}/:
#
#     bash experiments/gpu_capacity.sh WORKDIR fig7    # fig7 and tables 6-8
#     bash experiments/gpu_capacity.sh WORKDIR fig9
#     bash experiments/gpu_capacity.sh WORKDIR report  # the reports of what finished
#
# fig7 trains its runs (six processes at once, each run's seeds stacked) while the
# tables' own runs train beside it (three processes); the tables' base runs (SSE N = 4,
# k = 1 with softmax keys, gate "both", shared QKV; table6's GLA reference) are the
# same configurations as fig7's N4_k1 and GLA_dk<2 Dk>, so their directories are
# copied from fig7 instead of trained again. Each sweep's report lands in
# WORKDIR/<sweep>_gpu/ (results.md/json/csv and the figure). Calling it again with the
# same WORKDIR skips the finished runs and resumes the others from their checkpoints.
set -u
cd "$(dirname "$0")/.."
W=${1:-workdir}; PART=${2:-fig7}
run() { python3 -m experiments.ablation --workdir="$W" "$@"; }
report() { run --config="configs/$1.py" --report_only > "$W/$1_report.log" 2>&1 \
  || echo "report of $1 failed: see $W/$1_report.log"; }

share_with_tables() {
  # What the tables share with fig7 (the same train config, so the runner accepts it).
  local dk pair src dest
  dk=$(python3 -c "from configs import fig7; print(2 * fig7.setting('gpu').key_dim)")
  for pair in table6_gpu/softmax:N4_k1 table7_gpu/both:N4_k1 table8_gpu/shared:N4_k1 \
              table6_gpu/GLA_dk$dk:GLA_dk$dk; do
    src="$W/fig7_gpu/${pair#*:}"; dest="$W/${pair%%:*}"
    if [ -d "$src" ] && [ ! -d "$dest" ]; then cp -r "$src" "$dest"; fi
  done
}

mkdir -p "$W"
case "$PART" in
  fig7)
    run --config=configs/fig7.py > "$W/fig7.log" 2>&1 &
    fig7=$!
    { run --config=configs/table6.py --only=silu,identity --workers=2
      run --config=configs/table7.py --only=none,write,read --workers=3
      run --config=configs/table8.py --only=separate --workers=1
    } > "$W/tables.log" 2>&1
    wait "$fig7"
    share_with_tables
    for sweep in fig7 table6 table7 table8; do report "$sweep"; done ;;
  fig9)
    run --config=configs/fig9.py > "$W/fig9.log" 2>&1
    report fig9 ;;
  report)
    share_with_tables
    for sweep in fig7 table6 table7 table8 fig9; do
      [ -d "$W/${sweep}_gpu" ] && report "$sweep"
    done ;;
  *) echo "PART: fig7, fig9 or report, not $PART" >&2; exit 2 ;;
esac
