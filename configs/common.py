"""Builders shared by the experiment configs (`configs/<figure>.py`).

A config file spells its setting (widths, key dims, pair counts, steps, learning rates,
seeds; `fig7.setting` for fig7 and tables 6-8) and builds its experiment from it with
these functions. An experiment config is an `ml_collections.ConfigDict` with:
  name         sweep name: runs land in <workdir>/<name>/<run>/lr<lr>_s<seed>/
  description  what is compared, and the paper's finding
  train        the base `sse_jax.train` config every run starts from
  runs         list of {name, labels, overrides}: `overrides` are dotted keys of
               `train` (e.g. "model.sse.num_partitions"), `labels` are what the
               table and figure group by (family, line, N, k, variant, ...)
  lrs          learning rates tried for every run; per run the one with the lowest
               final loss on the VALIDATION stream wins ("tune the learning rate per
               family"); reported numbers come from the separate test sets
  seeds        training seeds; results report mean and spread over them
  figure       a figure registered in `experiments.plots` ("capacity", "bars",
               "vs_width", "vs_partitions"); metric: the summary metric drawn
  controls     optional dict(small=<run>, large=<run>, min_gap=<fraction>): the runs
               whose accuracy gap shows that the setting is capacity-bound
               (`experiments.verdict`)
  stack        train each run's learning rates and seeds as one vmapped program
               (the runner's --stack, unless the flag is given)
  workers      runs trained at once in child processes (the runner's --workers,
               unless the flag is given)
  paper        the paper's numbers for the same comparison (for the report only)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from pallas_kernels import chunk_gla
from sse_jax import train as train_lib
from sse_jax.ops import impl as impl_lib

VARIANTS = ("gpu", "cpu")


def variant(arg: str | None) -> str:
  """The size named by the config argument: "" / "gpu" (default) or "cpu"."""
  name = (arg or "gpu").lower()
  if name not in VARIANTS:
    raise ValueError(f"config argument {arg!r}: use ':cpu' or ':gpu' (the default)")
  return name


def mqar(s, *, split: str = "train", gap_mode: str = "none", gap_len: int = 0,
         max_pairs: int | None = None) -> ml_collections.ConfigDict:
  """MQAR data config (see `sse_jax.data.mqar`): P uniform in [s.min_pairs, max_pairs]."""
  return ml_collections.ConfigDict(dict(
      kind="mqar", vocab_size=s.vocab_size, num_pairs=max_pairs or s.max_pairs,
      min_pairs=s.min_pairs, seq_len=s.seq_len, num_queries=None, gap_mode=gap_mode,
      gap_len=gap_len, seed=0, num_examples=1 << 30, split=split))


def sse_mixer(s, **overrides) -> dict[str, Any]:
  """SSE layer fields for small synthetic-recall models.

  A width-4 short convolution (without it no small model learns the MQAR key -> value
  binding at all), LoRA rank 16 for the shared partition (the paper's 64 exceeds these
  widths), the setting's key dim; else the paper's defaults.
  """
  fields = dict(short_conv=4, lora_rank=16, num_partitions=4, top_k=1,
                key_dim=s.key_dim, chunk_size=s.chunk_size, impl=s.sse_impl)
  fields.update(overrides)
  return fields


def gla_mixer(s, **overrides) -> dict[str, Any]:
  """GLA layer fields like `sse_mixer`'s; a Pallas impl falls back to its algorithm on
  the XLA core for a key dim the kernels do not take (GLA controls below 16)."""
  fields = dict(short_conv=4, key_dim=s.key_dim, chunk_size=s.chunk_size, impl=s.gla_impl)
  fields.update(overrides)
  impl, dk = fields["impl"], fields["key_dim"]
  if impl == impl_lib.Impl.AUTO.value or dk is None:  # auto picks XLA there by itself
    return fields
  plan = impl_lib.named(impl)
  # The key dim alone (as Dk and Dv): the value dim, hidden / heads, is one they take.
  if isinstance(plan.core, impl_lib.PallasCore) and chunk_gla.shape_error(None, dk, dk):
    fields["impl"] = dataclasses.replace(plan, core=impl_lib.XlaCore()).name
  return fields


def model(s, pattern: str | None = None, *, sse=None, gla=None, attention=None,
          hidden: int | None = None) -> dict[str, Any]:
  """`ModelConfig.create` kwargs; pattern defaults to pure SSE of s.layers layers."""
  hidden = hidden or s.hidden
  pattern = pattern or "S" * s.layers
  out = dict(pattern=pattern, vocab_size=s.vocab_size, hidden=hidden,
             num_heads=s.num_heads, mlp_dim=2 * hidden, tie_embeddings=True,
             aux_loss_coef=0.01)
  if "S" in pattern:
    out["sse"] = sse if sse is not None else sse_mixer(s)
  if "G" in pattern:
    out["gla"] = gla if gla is not None else gla_mixer(s)
  if "A" in pattern:
    out["attention"] = attention if attention is not None else {}
  return out


def train(s, model_kwargs: dict[str, Any], data: ml_collections.ConfigDict | None = None
          ) -> ml_collections.ConfigDict:
  """The base training config: the validation stream is `data` on its validation
  split (learning rates are chosen on it), the reported numbers come from the test sets
  of s.eval_pairs."""
  cfg = train_lib.default_config()
  cfg.model = model_kwargs
  cfg.data = data if data is not None else mqar(s)
  cfg.eval_data = ml_collections.ConfigDict(dict(cfg.data.to_dict(), split="validation"))
  cfg.eval_pairs = tuple(s.eval_pairs)
  cfg.batch_size = s.batch_size
  cfg.num_steps = s.num_steps
  cfg.warmup_steps = s.warmup_steps
  cfg.lr = s.lrs[0]
  cfg.eval_every = s.eval_every
  cfg.log_every = s.eval_every
  cfg.checkpoint_every = s.eval_every * 2
  cfg.data_workers = s.data_workers
  cfg.eval_batches = 4
  cfg.compute_dtype = s.compute_dtype
  return cfg


def run(name: str, labels: dict[str, Any], **overrides) -> dict[str, Any]:
  """One run of a sweep: dotted-key overrides of the base train config."""
  return dict(name=name, labels=labels, overrides=overrides)


def experiment(name: str, s, base: ml_collections.ConfigDict, runs: list[dict[str, Any]],
               *, figure: str, metric: str = "max_pairs_accuracy", description: str,
               paper: dict[str, Any] | None = None) -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.name = f"{name}_{s.variant}"
  cfg.description = description
  cfg.train = base
  cfg.runs = runs
  cfg.lrs = tuple(s.lrs)  # tuples can be overridden: --config.lrs="(1e-3,)"
  cfg.seeds = tuple(s.seeds)
  cfg.figure = figure
  cfg.metric = metric
  cfg.stack = True
  cfg.workers = s.workers
  cfg.paper = paper or {}
  return cfg
