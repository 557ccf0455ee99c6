r"""Fig. 7: recall vs the number of partitions N, at k/N = 25% and 50%.

    python -m experiments.ablation --config=configs/fig7.py:cpu    # 2 CPU cores, minutes
    python -m experiments.ablation --config=configs/fig7.py        # GPU size

Paper (2B model, 20B tokens, average of real retrieval tasks): recall rises with N, and
at the same N activating 50% of the partitions beats 25%. Here: MQAR answer accuracy of
a 2-layer SSE model with a width-4 short convolution (without it no small model learns
MQAR, SPEC section 5). k must be a whole number >= 1, so N = 2 exists only at 50% and
N = 1 (one partition, k = 1: GLA plus the shared partition) is the common start of both
lines. GLA and Transformer models of the same width are drawn as reference levels.
"""

from configs import common


def get_config(arg=None):
  s = common.size(arg)
  base = common.train(s, common.model(s))
  runs = [common.run("N1_k1", dict(N=1, k=1, ratio="all"),
                     **{"model.sse.num_partitions": 1, "model.sse.top_k": 1})]
  for n in (2, 4, 8, 16, 32):
    for ratio in (0.25, 0.5):
      k = int(n * ratio)
      if k < 1:
        continue
      runs.append(common.run(f"N{n}_k{k}", dict(N=n, k=k, ratio=ratio),
                             **{"model.sse.num_partitions": n, "model.sse.top_k": k}))
  runs.append(common.run("GLA", dict(baseline="GLA"), model=common.model(s, "G" * s["layers"])))
  runs.append(common.run("Transformer", dict(baseline="Transformer"),
                         model=common.model(s, "A" * s["layers"])))
  return common.experiment(
      "fig7", s, base, runs, figure="vs_partitions",
      description="MQAR recall vs number of partitions N at k/N = 25% and 50%",
      paper=dict(finding="recall rises with N; 50% > 25% at the same N (2B, 20B tokens)"))
