r"""Table 8: partitions share W_q / W_k / W_v, or each has its own (MoM-like).

    python -m experiments.ablation --config=configs/table8.py:cpu
    python -m experiments.ablation --config=configs/table8.py

Paper (600M, 15B tokens, real-retrieval average): shared 31.16 with 300M non-embedding
parameters, separate 25.95 with 580M. Here: the capacity-bound MQAR setting of fig7
(`configs/fig7.py`, `setting`), SSE with N = 4, k = 1, scored at the largest pair count;
the parameter counts of both models are in the results. A MoM reference line (Table 8's
"MoM-like" end point, family "mom"): the Mixture-of-Memories mixer with the same N = 4
memories, k = 1 and a shared memory, the same key dim and short conv, and the GLA
transition, whose memories have their own W_k / W_v (and gates) as a real MoM layer does.
"""

from configs import common
from configs import fig7


def get_config(arg=None):
  s = fig7.setting(common.variant(arg))
  base = common.train(s, common.model(s))
  sse = common.sse_mixer(s)
  # shared QKV is the default: that run is fig7's N4_k1 exactly.
  runs = [common.run("shared", dict(family="sse", variant="shared QKV")),
          common.run("separate", dict(family="sse", variant="per-partition QKV"),
                     **{"model.sse.share_partition_params": False}),
          common.run("mom", dict(family="mom", variant="MoM"),
                     model=fig7.mom_model(s, sse["num_partitions"], sse["top_k"]))]
  return common.experiment(
      "table8", s, base, runs, figure="bars",
      description="shared vs per-partition Q/K/V projections, MoM for reference "
                  "(capacity-bound MQAR)",
      paper={"shared QKV": 31.16, "per-partition QKV": 25.95})
