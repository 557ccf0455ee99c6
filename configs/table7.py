r"""Table 7: where the router weight e_t^i multiplies: write and read, neither, one.

    python -m experiments.ablation --config=configs/table7.py:cpu
    python -m experiments.ablation --config=configs/table7.py

Paper (2B, 100B tokens, real-retrieval average): both 56.63, none 51.87, write only
50.92, read only 53.96. With "none" the router learns only from the load-balance loss
(the selected partitions get weight 1, so the LM loss has no path to W_e). Here: MQAR
answer accuracy of a 2-layer SSE model, N = 4, k = 1.
"""

from configs import common


def get_config(arg=None):
  s = common.size(arg)
  base = common.train(s, common.model(s))
  runs = [common.run(gate, dict(variant=f"gate {gate}"),
                     **{"model.sse.gate_placement": gate})
          for gate in ("both", "none", "write", "read")]
  return common.experiment(
      "table7", s, base, runs, figure="bars",
      description="gate placement of the router weight: both / none / write / read",
      paper={"gate both": 56.63, "gate none": 51.87, "gate write": 50.92,
             "gate read": 53.96})
