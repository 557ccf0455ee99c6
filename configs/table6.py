r"""Table 6: the key feature map, softmax vs SiLU (and identity), where capacity matters.

    python -m experiments.ablation --config=configs/table6.py:cpu
    python -m experiments.ablation --config=configs/table6.py

Paper (600M, 15B tokens, real-retrieval average): softmax 31.16, SiLU 24.23. Here: the
capacity-bound MQAR setting of fig7 (`configs/fig7.py`, `setting`), SSE with N = 4, k = 1
and each key map, scored at the largest pair count; GLA at the SSE's active state
(2 Dk key rows per head) for reference.
"""

from configs import common
from configs import fig7


def get_config(arg=None):
  s = fig7.setting(common.variant(arg))
  base = common.train(s, common.model(s))
  # softmax is the default key map: that run is fig7's N4_k1 exactly (its directory can
  # be copied in; experiments/gpu_capacity.sh does).
  runs = [common.run(act, dict(family="sse", variant=f"SSE key {act}"),
                     **({} if act == "softmax" else {"model.sse.key_activation": act}))
          for act in ("softmax", "silu", "identity")]
  runs.append(fig7.gla_run(s, 2 * s.key_dim))
  return common.experiment(
      "table6", s, base, runs, figure="bars",
      description="SSE key feature map: softmax vs SiLU vs identity (capacity-bound MQAR)",
      paper={"SSE key softmax": 31.16, "SSE key silu": 24.23})
