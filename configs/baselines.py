r"""The baselines on MQAR: does the Transformer need the short convolution too?

    python -m experiments.ablation --config=configs/baselines.py:cpu
    python -m experiments.ablation --config=configs/baselines.py

Not a table of the paper. Every linear-attention model in these configs has a width-4
short convolution on its q / k / v projections, without which SPEC section 5 found that
no small model learns MQAR; fig7's Transformer baseline has none, and it is the slowest
to learn the task (`results/cpu_long_probe/`, `results/gpu_long_probe/`). This sweep
trains the same 2-layer models as fig7: GLA, the base SSE model (N = 4, k = 1), the
Transformer, and the Transformer with the same short convolution on its q / k / v
projections (before RoPE).
"""

from configs import common


def get_config(arg=None):
  s = common.size(arg)
  base = common.train(s, common.model(s))
  attention = lambda **kw: common.model(s, "A" * s["layers"], attention=kw)
  runs = [
      common.run("GLA", dict(model="GLA"), model=common.model(s, "G" * s["layers"])),
      common.run("SSE", dict(model="SSE N=4 k=1")),
      common.run("Transformer", dict(model="Transformer"), model=attention()),
      common.run("Transformer_conv", dict(model="Transformer + short conv"),
                 model=attention(short_conv=4)),
  ]
  return common.experiment(
      "baselines", s, base, runs, figure="bars",
      description="GLA, SSE and the Transformer with and without a short convolution")
