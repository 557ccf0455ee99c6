r"""Fig. 9 (Appendix A): row-sparse top-k keys vs dense keys on MQAR with gap tokens.

    python -m experiments.ablation --config=configs/fig9.py:cpu
    python -m experiments.ablation --config=configs/fig9.py

Paper: 2-layer, 2-head GLA (also GSA, MetaLA) at widths 64..512, with zero tokens or
random-noise tokens inserted between the key-value pairs and the queries; the top-k
variant (k = d/4 rows written per token, softmax over them; rows outside the top-k keep
their state: no decay, Eq. 7-8) recalls more and degrades less with noise.

Here: GLA with a width-4 short convolution and three key maps: identity ("dense", fla's
GLA), softmax over all rows ("dense-softmax": the same key map as top-k without the
sparsity, so sparsity is the only difference) and "topk-softmax" ("top-k"). Trained on
a mixture of pair counts with a gap of `gap_len` zero or noise tokens, scored on test
sets of fixed P.

GPU setting: fig7's pair counts (P 2..16, the range dense GLA learns within the budget),
with the 32-token gap. The per-head key dim is width / `key_divisor` (16: Dk 4, 8, 16,
32 at widths 64..512), so the state, not the width of the rest of the model, limits
recall: with Dk = width / 2 the narrowest model already holds 32 key rows per head,
which P <= 16 cannot fill, and at the pair counts that would fill it (P up to 24 at
T = 128) dense GLA mostly did not learn the lookup within 3000 steps. The controls are
dense GLA without a gap at the narrowest and widest width (`none_dense_d*`): the
setting is capacity-bound if they are >= 20 points apart at the largest P.
"""

import ml_collections

from configs import common

VARIANTS = (("dense", "identity"), ("dense-softmax", "softmax"), ("top-k", "topk-softmax"))


def setting(variant: str) -> ml_collections.ConfigDict:
  s = ml_collections.ConfigDict()
  s.variant = variant
  s.num_heads = 2
  s.layers = 2
  s.key_dim = None                  # the base model's: width / heads
  if variant == "cpu":
    s.widths = (16, 32)
    s.key_divisor = 2               # Dk per head = width / 2: 8, 16
    s.hidden = 32
    s.vocab_size = 256
    s.seq_len = 48                  # 2 * 8 pairs + 16 gap + 2 * 8 queries
    s.min_pairs = 1
    s.max_pairs = 8
    s.gap_len = 16
    s.eval_pairs = (2, 4, 8)
    s.batch_size = 32
    s.num_steps = 1500
    s.warmup_steps = 75
    s.eval_every = 500
    s.lrs = (3e-3,)
    s.seeds = (0, 1)
    s.chunk_size = 16
    s.gla_impl = "chunk"
    s.compute_dtype = "float32"
    s.data_workers = 0
    s.workers = 2
  else:
    s.widths = (64, 128, 256, 512)
    s.key_divisor = 16              # Dk per head = width / 16: 4, 8, 16, 32
    s.hidden = 128
    s.vocab_size = 512
    s.seq_len = 96                  # 2 * 16 pairs + 32 gap + 2 * 16 queries
    s.min_pairs = 2
    s.max_pairs = 16
    s.gap_len = 32
    s.eval_pairs = (4, 8, 16)
    s.batch_size = 128
    s.num_steps = 2000              # dense GLA at P <= 16 levels off by ~1750 (fig7)
    s.warmup_steps = 100
    s.eval_every = 250
    s.lrs = (3e-3,)                 # fig7's, chosen on its validation stream
    s.seeds = (0, 1, 2)
    s.chunk_size = 32               # T = 96: three chunks
    s.gla_impl = "pallas_chunk"     # where the kernels take the key dim, else XLA
    s.compute_dtype = "bfloat16"
    s.data_workers = 1
    s.workers = 8
  return s


def get_config(arg=None):
  s = setting(common.variant(arg))
  base = common.train(s, common.model(s, "G" * s.layers),
                      data=common.mqar(s, gap_mode="zero", gap_len=s.gap_len))
  runs = []
  for gap_mode in ("none", "zero", "noise"):
    gap_len = 0 if gap_mode == "none" else s.gap_len
    data = common.mqar(s, gap_mode=gap_mode, gap_len=gap_len)
    eval_data = common.mqar(s, gap_mode=gap_mode, gap_len=gap_len, split="validation")
    # Without a gap only the controls: dense keys at the narrowest and widest width.
    widths = (s.widths[0], s.widths[-1]) if gap_mode == "none" else s.widths
    variants = VARIANTS[:1] if gap_mode == "none" else VARIANTS
    for width in widths:
      dk = width // s.key_divisor
      for name, key in variants:
        gla = common.gla_mixer(s, key_activation=key, key_dim=dk)
        model = common.model(s, "G" * s.layers, hidden=width, gla=gla)
        runs.append(common.run(f"{gap_mode}_{name}_d{width}",
                               dict(family="gla", width=width, variant=name, gap=gap_mode,
                                    key_dim=dk),
                               model=model, data=data, eval_data=eval_data))
  narrow, wide = s.widths[0], s.widths[-1]
  cfg = common.experiment(
      "fig9", s, base, runs, figure="vs_width",
      description="row-sparse top-k keys vs dense keys, MQAR with zero / noise gaps",
      paper=dict(finding="top-k variants recall more and degrade less with noise"))
  cfg.controls = dict(small=f"none_dense_d{narrow}", large=f"none_dense_d{wide}", min_gap=0.2)
  return cfg
