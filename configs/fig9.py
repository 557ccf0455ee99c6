r"""Fig. 9 (Appendix A): row-sparse top-k keys vs dense keys on MQAR with gap tokens.

    python -m experiments.ablation --config=configs/fig9.py:cpu
    python -m experiments.ablation --config=configs/fig9.py

Paper: 2-layer, 2-head GLA (also GSA, MetaLA) at widths 64..512, with zero tokens or
random-noise tokens inserted between the key-value pairs and the queries; the top-k
variant (k = d/4 rows written per token, softmax over them) recalls more and degrades
less with noise. Here: GLA with identity keys (dense) vs "topk-softmax" keys, both with
a width-4 short convolution.
"""

from configs import common


def get_config(arg=None):
  s = common.size(arg)
  widths = (16, 32) if s["variant"] == "cpu" else (64, 128, 256, 512)
  gap = s["seq_len"] // 4
  base = common.train(s, common.model(s, "G" * s["layers"]))
  runs = []
  for gap_mode in ("zero", "noise"):
    for width in widths:
      for key, variant in (("identity", "dense"), ("topk-softmax", "top-k")):
        data = common.mqar(s, gap_mode=gap_mode, gap_len=gap)
        eval_data = common.mqar(s, gap_mode=gap_mode, gap_len=gap, split="validation")
        model = common.model(s, "G" * s["layers"], hidden=width,
                             gla=common.gla_mixer(s, key_activation=key))
        runs.append(common.run(f"{gap_mode}_{variant}_d{width}",
                               dict(width=width, variant=variant, gap=gap_mode),
                               model=model, data=data, eval_data=eval_data))
  return common.experiment(
      "fig9", s, base, runs, figure="vs_width",
      description="row-sparse top-k keys vs dense keys, MQAR with zero / noise gaps",
      paper=dict(finding="top-k variants recall more and degrade less with noise"))
