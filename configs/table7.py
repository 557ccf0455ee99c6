r"""Table 7: where the router weight e_t^i multiplies: write and read, neither, one.

    python -m experiments.ablation --config=configs/table7.py:cpu
    python -m experiments.ablation --config=configs/table7.py

Paper (2B, 100B tokens, real-retrieval average): both 56.63, none 51.87, write only
50.92, read only 53.96. With "none" the router learns only from the load-balance loss
(the selected partitions get weight 1, so the LM loss has no path to W_e). Here: the
capacity-bound MQAR setting of fig7 (`configs/fig7.py`, `setting`), SSE with N = 4,
k = 1, scored at the largest pair count.
"""

from configs import common
from configs import fig7


def get_config(arg=None):
  s = fig7.setting(common.variant(arg))
  base = common.train(s, common.model(s))
  # "both" is the default: that run is fig7's N4_k1 exactly.
  runs = [common.run(gate, dict(family="sse", variant=f"gate {gate}"),
                     **({} if gate == "both" else {"model.sse.gate_placement": gate}))
          for gate in ("both", "none", "write", "read")]
  return common.experiment(
      "table7", s, base, runs, figure="bars",
      description="gate placement of the router weight: both / none / write / read "
                  "(capacity-bound MQAR)",
      paper={"gate both": 56.63, "gate none": 51.87, "gate write": 50.92,
             "gate read": 53.96})
