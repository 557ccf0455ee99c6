r"""Table 8: partitions share W_q / W_k / W_v, or each has its own (MoM-like).

    python -m experiments.ablation --config=configs/table8.py:cpu
    python -m experiments.ablation --config=configs/table8.py

Paper (600M, 15B tokens, real-retrieval average): shared 31.16 with 300M non-embedding
parameters, separate 25.95 with 580M. Here: the capacity-bound MQAR setting of fig7
(`configs/fig7.py`, `setting`), SSE with N = 4, k = 1, scored at the largest pair count;
the parameter counts of both models are in the results.
"""

from configs import common
from configs import fig7


def get_config(arg=None):
  s = fig7.setting(common.variant(arg))
  base = common.train(s, common.model(s))
  # shared QKV is the default: that run is fig7's N4_k1 exactly.
  runs = [common.run("shared", dict(family="sse", variant="shared QKV")),
          common.run("separate", dict(family="sse", variant="per-partition QKV"),
                     **{"model.sse.share_partition_params": False})]
  return common.experiment(
      "table8", s, base, runs, figure="bars",
      description="shared vs per-partition Q/K/V projections (capacity-bound MQAR)",
      paper={"shared QKV": 31.16, "per-partition QKV": 25.95})
