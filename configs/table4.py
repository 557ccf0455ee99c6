r"""Table 4 at small scale: a trained Transformer converted into SSE-H and GLA-H.

    python -m experiments.convert --config=configs/table4.py:cpu   # 2 CPU cores, 1 seed
    python -m experiments.convert --config=configs/table4.py        # one GPU, 3 seeds

(run it with experiments.convert, not experiments.ablation: the converted runs start
from the Transformer's weights, which only the conversion runner puts in place.)

Paper (12B, real retrieval): converting a trained Transformer to SSE-H keeps more of
its retrieval than converting it to GLA-H. Here: the capacity-bound MQAR data of fig7
(`configs/fig7.py`, `setting`: the same pair counts, test sets, batch, steps and lr), a
2-layer Transformer (with the linear mixers' width-4 short conv on q / k / v, without
which it does not learn MQAR at the CPU size) trained for the setting's num_steps, then
hybrids whose `replaced` layers become SSE (N = 4, k = 1, as fig7's SSE runs) or GLA,
with the attention head dim as key and value dim (D / H: the shapes W_q / W_k / W_v /
W_o need to carry over), trained on for `continue_fraction` of the steps:

  Transformer        the source (labels init "trained")
  SSE-H_converted    replaced layers initialised from the Transformer (init "converted")
  GLA-H_converted
  SSE-H_scratch      the same hybrids from their own init, the same continued budget:
  GLA-H_scratch      the control that lets "conversion helps" fail (init "scratch")

The replaced layer is the LAST one ("AS" / "AG"). It is the layer whose output the
answer is read from, so its state, not an attention cache, has to hold the pairs (if the
first layer were replaced, the lookup could stay with attention; not measured here).
The :cpu variant trains one seed; the GPU variant three.
"""

import ml_collections

from configs import common
from configs import fig7

HYBRIDS = {"SSE-H": "S", "GLA-H": "G"}


def setting(variant: str) -> ml_collections.ConfigDict:
  """fig7's setting with the conversion's own fields."""
  s = fig7.setting(variant)
  s.attention_conv = 4              # the linear mixers' short conv width: it carries over
  s.replaced = (s.layers - 1,)      # the layers converted
  s.continue_fraction = 0.25        # continued steps / the source's steps
  s.seeds = (0,) if variant == "cpu" else (0, 1, 2)
  s.workers = 1
  return s


def hybrid_pattern(s, letter: str) -> str:
  return "".join(letter if i in s.replaced else "A" for i in range(s.layers))


def hybrid_model(s, letter: str) -> dict:
  """The hybrid: the Transformer's attention layers, `letter` mixers with key and value
  dim None (= the attention head dim) at the replaced layers."""
  return common.model(s, hybrid_pattern(s, letter),
                      attention=dict(short_conv=s.attention_conv),
                      sse=common.sse_mixer(s, key_dim=None),
                      gla=common.gla_mixer(s, key_dim=None))


def get_config(arg=None):
  s = setting(common.variant(arg))
  source = common.model(s, "A" * s.layers, attention=dict(short_conv=s.attention_conv))
  base = common.train(s, source)
  runs = [common.run("Transformer", dict(family="transformer", init="trained",
                                         variant="original"), model=source)]
  for init in ("converted", "scratch"):
    for hybrid, letter in HYBRIDS.items():
      run = common.run(f"{hybrid}_{init}", dict(family=hybrid.lower(), hybrid=hybrid,
                                                 init=init, variant=f"{hybrid} {init}"),
                       model=hybrid_model(s, letter))
      run.update(continued=True, replaced=tuple(s.replaced))
      if init == "converted":
        run["init"] = "Transformer"
      runs.append(run)
  cfg = common.experiment(
      "table4", s, base, runs, figure="bars",
      description="a trained Transformer converted to SSE-H / GLA-H (layers "
                  f"{list(s.replaced)} replaced) vs the same hybrids from scratch, MQAR",
      paper=dict(finding="converted SSE-H keeps more retrieval than converted GLA-H "
                         "(12B, real retrieval)"))
  cfg.source = "Transformer"
  cfg.hybrids = tuple(HYBRIDS)
  cfg.continue_fraction = s.continue_fraction
  return cfg
