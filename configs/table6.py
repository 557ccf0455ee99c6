r"""Table 6: the key feature map, softmax vs SiLU (and identity).

    python -m experiments.ablation --config=configs/table6.py:cpu
    python -m experiments.ablation --config=configs/table6.py

Paper (600M, 15B tokens, real-retrieval average): softmax 31.16, SiLU 24.23. Here: MQAR
answer accuracy of a 2-layer SSE model (N = 4, k = 1) with each key map, and a GLA model
of the same width for reference.
"""

from configs import common


def get_config(arg=None):
  s = common.size(arg)
  base = common.train(s, common.model(s))
  runs = [common.run(act, dict(variant=f"SSE key {act}"),
                     **{"model.sse.key_activation": act})
          for act in ("softmax", "silu", "identity")]
  runs.append(common.run("GLA", dict(variant="GLA (reference)"),
                         model=common.model(s, "G" * s["layers"])))
  return common.experiment(
      "table6", s, base, runs, figure="bars",
      description="SSE key feature map: softmax vs SiLU vs identity",
      paper={"SSE key softmax": 31.16, "SSE key silu": 24.23})
