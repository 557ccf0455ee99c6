"""Shared builders for the experiment configs (`configs/<figure>.py`).

An experiment config is an `ml_collections.ConfigDict` with:
  name         sweep name: runs land in <workdir>/<name>/<run>/lr<lr>_s<seed>/
  description  what is compared, and the paper's finding
  train        the base `sse_jax.train` config every run starts from
  runs         list of {name, labels, overrides}: `overrides` are dotted keys of
               `train` (e.g. "model.sse.num_partitions"), `labels` are what the
               table and figure group by
  lrs          learning rates tried for every run (the best final eval loss wins,
               per run: "tune the learning rate per family")
  seeds        training seeds; results report mean and spread over them
  figure       "vs_partitions" | "bars" | "vs_width"; metric: the summary metric drawn
  paper        the paper's numbers for the same comparison (for the report only)
"""

from __future__ import annotations

from typing import Any

import ml_collections

from sse_jax import train as train_lib

# Model sizes of the two variants every config offers: a GPU size large enough for
# the MQAR task to be learnt (SPEC section 5 calibration) and a CPU size that runs a
# whole sweep on a 2-core laptop in minutes.
#
# Implementations: at the GPU size (B = 128 short sequences of T = 128) the masking form
# is the fastest SSE op; varlen pads every (sequence, partition) segment to a whole
# chunk, which costs most when sequences are short and N is large. Measured train step
# on the H200 (2 layers, width 128, bf16): N=4 k=1: varlen 42.5 ms, masking 9.0,
# pallas_varlen 8.6, pallas_masking 6.4; N=32 k=16: varlen 304, masking 65,
# pallas_masking 34; dense GLA: chunk 3.3, pallas_chunk 2.9.
#
# Steps: on the H200 most SSE runs were still on their way off the ~20% plateau at step
# 4000 (the first GPU sweeps); every fig7 / table run trained to the end of a
# 12000-step schedule had left it in every seed and was nearly flat by then (the
# slowest seed, N4_k2 s0, still rising 0.89 -> 0.91 over the last 2000 steps;
# results/gpu_long_probe/12000_steps*/), so the GPU size trains 12000 steps. Its MQAR
# batches come from 4 worker processes: one host thread could not keep the GPU busy
# (three stacked seeds: 13 -> 87 steps/s on the H200).
GPU = dict(hidden=128, num_heads=2, layers=2, batch_size=128, steps=12000, eval_every=500,
           warmup=200, vocab=8192, pairs=16, seq_len=128, chunk=64, lrs=(1e-3, 3e-3),
           sse_impl="pallas_masking", gla_impl="pallas_chunk", data_workers=4)
CPU = dict(hidden=32, num_heads=2, layers=2, batch_size=16, steps=100, eval_every=50,
           warmup=10, vocab=64, pairs=4, seq_len=32, chunk=16, lrs=(3e-3,),
           sse_impl="varlen", gla_impl="chunk", data_workers=0)


def size(arg: str | None) -> dict[str, Any]:
  """The size preset named by the config argument: "" / "gpu" (default) or "cpu"."""
  arg = (arg or "gpu").lower()
  if arg not in ("gpu", "cpu"):
    raise ValueError(f"config argument {arg!r}: use ':cpu' or ':gpu' (default)")
  return dict(CPU if arg == "cpu" else GPU, variant=arg)


def mqar(s: dict[str, Any], *, split: str = "train", gap_mode: str = "none",
         gap_len: int = 0, pairs: int | None = None,
         seq_len: int | None = None) -> ml_collections.ConfigDict:
  """MQAR data config (see `sse_jax.data.mqar`)."""
  return ml_collections.ConfigDict(dict(
      kind="mqar", vocab_size=s["vocab"], num_pairs=pairs or s["pairs"],
      seq_len=seq_len or s["seq_len"], num_queries=None, gap_mode=gap_mode,
      gap_len=gap_len, seed=0, num_examples=1 << 30, split=split))


def sse_mixer(s: dict[str, Any], **overrides) -> dict[str, Any]:
  """SSE layer fields for small synthetic-recall models.

  A width-4 short convolution: SPEC section 5 measured that without it no small model
  learns the MQAR key -> value binding at all. LoRA rank 16 (the paper's 64 exceeds
  these widths). Chunk length to suit the sequence length. Else the paper defaults.
  """
  fields = dict(short_conv=4, lora_rank=16, num_partitions=4, top_k=1,
                chunk_size=s["chunk"], impl=s["sse_impl"])
  fields.update(overrides)
  return fields


def gla_mixer(s: dict[str, Any], **overrides) -> dict[str, Any]:
  fields = dict(short_conv=4, chunk_size=s["chunk"], impl=s["gla_impl"])
  fields.update(overrides)
  return fields


def model(s: dict[str, Any], pattern: str | None = None, *, sse=None, gla=None,
          attention=None, hidden: int | None = None) -> dict[str, Any]:
  """`ModelConfig.create` kwargs; pattern defaults to pure SSE of s["layers"] layers."""
  hidden = hidden or s["hidden"]
  pattern = pattern or "S" * s["layers"]
  out = dict(pattern=pattern, vocab_size=s["vocab"], hidden=hidden,
             num_heads=s["num_heads"], mlp_dim=2 * hidden, tie_embeddings=True,
             aux_loss_coef=0.01)
  if "S" in pattern:
    out["sse"] = sse if sse is not None else sse_mixer(s)
  if "G" in pattern:
    out["gla"] = gla if gla is not None else gla_mixer(s)
  if "A" in pattern:
    out["attention"] = attention if attention is not None else {}
  return out


def train(s: dict[str, Any], model_kwargs: dict[str, Any],
          data: ml_collections.ConfigDict | None = None,
          eval_data: ml_collections.ConfigDict | None = None) -> ml_collections.ConfigDict:
  """The base training config of an experiment."""
  cfg = train_lib.default_config()
  cfg.model = model_kwargs
  cfg.data = data if data is not None else mqar(s)
  if eval_data is None:
    eval_data = ml_collections.ConfigDict(cfg.data.to_dict())
    eval_data.split = "validation"
  cfg.eval_data = eval_data
  cfg.batch_size = s["batch_size"]
  cfg.num_steps = s["steps"]
  cfg.warmup_steps = s["warmup"]
  cfg.lr = s["lrs"][0]
  cfg.eval_every = s["eval_every"]
  cfg.log_every = s["eval_every"]
  cfg.checkpoint_every = s["eval_every"] * 2
  cfg.data_workers = s["data_workers"]
  cfg.eval_batches = 4
  cfg.compute_dtype = "bfloat16" if s["variant"] == "gpu" else "float32"
  return cfg


def run(name: str, labels: dict[str, Any], **overrides) -> dict[str, Any]:
  """One run of a sweep: dotted-key overrides of the base train config."""
  return dict(name=name, labels=labels, overrides=overrides)


def experiment(name: str, s: dict[str, Any], base: ml_collections.ConfigDict,
               runs: list[dict[str, Any]], *, figure: str, metric: str = "eval_accuracy",
               description: str, paper: dict[str, Any] | None = None,
               seeds: tuple[int, ...] = (0,)) -> ml_collections.ConfigDict:
  cfg = ml_collections.ConfigDict()
  cfg.name = f"{name}_{s['variant']}"
  cfg.description = description
  cfg.train = base
  cfg.runs = runs
  cfg.lrs = tuple(s["lrs"])  # tuples can be overridden: --config.lrs="(1e-3,)"
  cfg.seeds = tuple(seeds)
  cfg.figure = figure
  cfg.metric = metric
  cfg.paper = paper or {}
  return cfg
