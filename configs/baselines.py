r"""The baselines on MQAR: does the Transformer need the short convolution too?

    python -m experiments.ablation --config=configs/baselines.py:cpu
    python -m experiments.ablation --config=configs/baselines.py

Not a table of the paper. Every linear-attention model in these configs has a width-4
short convolution on its q / k / v projections, without which no small model learns
MQAR; fig7's Transformer baseline has none. This sweep trains, in fig7's capacity-bound
setting (`configs/fig7.py`), GLA and SSE (N = 4, k = 1) at fig7's small key dim, the
Transformer, and the Transformer with the same short convolution on its q / k / v
projections (before RoPE).
"""

from configs import common
from configs import fig7


def get_config(arg=None):
  s = fig7.setting(common.variant(arg))
  base = common.train(s, common.model(s))
  attention = lambda **kw: common.model(s, "A" * s.layers, attention=kw)
  runs = [
      common.run("GLA", dict(model="GLA"), model=common.model(s, "G" * s.layers)),
      common.run("SSE", dict(model="SSE N=4 k=1")),
      common.run("Transformer", dict(model="Transformer"), model=attention()),
      common.run("Transformer_conv", dict(model="Transformer + short conv"),
                 model=attention(short_conv=4)),
  ]
  return common.experiment(
      "baselines", s, base, runs, figure="bars",
      description="GLA, SSE and the Transformer with and without a short convolution")
