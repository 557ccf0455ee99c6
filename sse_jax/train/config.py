"""The training config: `default_config()` and what is derived from it.

    config = default_config()            # a small MQAR run that trains on a CPU
    config.model.pattern = "SSSA"
    config.data.num_pairs = 32
    summary = train_and_evaluate(config, workdir)

`default_config` documents every field; `from_json` reads a run's config.json back.
`validate` rejects unknown or impossible values
before anything is built; `model_config`, `eval_data_config` and `fingerprint` turn the
config into what the trainer needs.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jax.numpy as jnp

from sse_jax.model import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Fields that may change when a run is resumed: they steer how the run is watched and
# where it runs, not what it computes. Everything else must match the checkpoint.
RUN_CONTROL = ("eval_data", "eval_pairs", "eval_every", "eval_batches", "log_every",
               "checkpoint_every", "keep_checkpoints", "mesh", "progress", "tags")

# Fewest answers a per-pair-count test set holds (`eval_pairs`).
MIN_TEST_ANSWERS = 1024


def default_config():
  """All training fields, with their defaults in brackets (an ml_collections.ConfigDict).

  model             keyword arguments of `ModelConfig.create`:
    pattern           mixer letters, one per layer ("S" SSE, "G" GLA, "A" attention) ["SS"]
    vocab_size        None: taken from the data (MQAR: data.vocab_size; text: 256) [None]
    hidden, num_heads, mlp_dim                                            [64, 2, 128]
    sse, gla, attention   mixer field overrides (dicts) or None for the mixer defaults
                      [sse: 4 partitions, top-1, chunk 16, conv 4, LoRA rank 8 (64 = the width)]
    tie_embeddings    logits use the input embedding [True]
    aux_loss_coef     weight of the SSE load-balance loss (in the model's aux_loss) [0.01]
    remat             a jax.checkpoint_policies name per block, or None [None]
  data              `sse_jax.data.make_source` config of the training stream
                    [MQAR: vocab 128, 8 pairs, 64 tokens]
  eval_data         config of the evaluation stream; None: `data` with
                    split="validation" (MQAR: an independent held-out stream), or, when
                    `data` already reads the validation split (a missing split is the
                    kind's default), with seed + 1; an error for a kind without a
                    seed [None]. It is the validation stream: the ablation runner
                    picks learning rates by its loss
  eval_pairs        MQAR only: pair counts P scored at every evaluation on held-out
                    TEST sets, one per P (eval_data with num_pairs = P, min_pairs None,
                    split "test"; the first examples of that stream, the same for every
                    run and seed), each of max(eval_batches, ceil(1024 / (batch_size Q)))
                    batches (Q queries per example), so >= 1024 answers; reported as the
                    eval record's `by_pairs` {P: {accuracy, loss, answers, agreement}}
                    [()]
  seed              model init, data shuffling and the training RNG [0]
  batch_size        GLOBAL batch: sequences per step over all processes and devices [32]
  data_workers      processes making the training batches (0: threads of this process);
                    the same batches either way, but the data-iterator state in a
                    checkpoint has another format, so a run resumes with its own [0]
  num_steps         optimizer steps; also the length of the cosine schedule, so it must
                    stay fixed when a run is resumed [1000]
  lr                peak learning rate, reached after `warmup_steps` [3e-3]
  warmup_steps      linear warm-up from 0 [100]
  min_lr_ratio      cosine decay from lr to lr * min_lr_ratio at num_steps [0.1]
  weight_decay      AdamW decoupled decay on kernels and embeddings, NOT on RMSNorm
                    scales or biases (leaves named "scale" / "bias") [0.1]
  b1                Adam first-moment decay [0.9]
  b2                Adam second-moment decay [0.95]
  eps               Adam epsilon [1e-8]
  grad_clip         clip the global gradient norm to this (0: no clipping) [1.0]
  compute_dtype     "bfloat16" | "float32": activations and matmul inputs ["bfloat16"]
  param_dtype       "float32" | "bfloat16": the master weights the optimizer updates
                    ["float32"]
  eval_every        evaluate every n steps (0: only at the end); always at the end [200]
  eval_batches      batches of `batch_size` per evaluation (fewer if the split ends) [8]
  log_every         average the training metrics over n steps, write them to
                    metrics.jsonl / TensorBoard, log a progress line [50]
  checkpoint_every  save every n steps (0: only at the end); always at the end [200]
  keep_checkpoints  how many of the latest checkpoints to keep [2]
  mesh              devices per mesh axis:
    data              on the "data" axis; -1: all devices / mesh.model [-1]
    model             on the "model" axis (tensor parallel heads / MLP / vocab) [1]
  progress          log progress lines (process 0 only; absl.logging INFO records,
                    written whatever the verbosity: `logs.Progress`) [True]
  tags              free-form notes (recorded in config.json, ignored by training) [{}]
  """
  import ml_collections  # pylint: disable=g-import-not-at-top

  from sse_jax.data import default_config as data_default  # pylint: disable=g-import-not-at-top

  data = data_default("mqar")
  data.vocab_size, data.num_pairs, data.seq_len = 128, 8, 64
  model = dict(pattern="SS", vocab_size=None, hidden=64, num_heads=2, mlp_dim=128,
               sse=dict(num_partitions=4, top_k=1, chunk_size=16, short_conv=4, lora_rank=8),
               gla=None, attention=None, tie_embeddings=True, aux_loss_coef=0.01,
               remat=None)
  return ml_collections.ConfigDict(dict(
      model=model, data=data, eval_data=None, eval_pairs=(), seed=0, batch_size=32, data_workers=0,
      num_steps=1000,
      lr=3e-3, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.1, b1=0.9, b2=0.95,
      eps=1e-8, grad_clip=1.0, compute_dtype="bfloat16", param_dtype="float32",
      eval_every=200, eval_batches=8, log_every=50, checkpoint_every=200,
      keep_checkpoints=2, mesh=dict(data=-1, model=1), progress=True, tags=dict()))


def from_json(path: str):
  """The config a run's config.json holds (`train_and_evaluate` writes it; so does
  `config.to_json()`): the defaults, each top-level field of the file replacing the
  default's (a field the file lacks keeps its default). A file that cannot be read or
  holds no JSON object is a ValueError naming it."""
  try:
    with open(path) as f:
      fields = json.load(f)
  except OSError as e:
    raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not JSON: {e}") from None
  if not isinstance(fields, dict):
    raise ValueError(f"{path} holds a {type(fields).__name__}, not a training config "
                     "(a JSON object of its fields)")
  config = default_config()
  for key, value in fields.items():
    config[key] = value
  return config


def to_dict(value: Any) -> Any:
  """Plain dicts from a ConfigDict (or a mapping / None)."""
  if value is None:
    return None
  if hasattr(value, "to_dict"):
    return value.to_dict()
  return copy.deepcopy(dict(value))


def _fail(field: str, value: Any, why: str):
  raise ValueError(f"train config: {field}={value!r} {why}")


def validate(config) -> None:
  """Raises ValueError naming the first bad field (unknown fields included)."""
  known = set(default_config().keys())
  unknown = sorted(set(config.keys()) - known)
  if unknown:
    _fail("fields", unknown, f"are unknown; known fields: {sorted(known)} "
          "(put free-form notes under `tags`)")
  missing = sorted(known - set(config.keys()))
  if missing:
    _fail("fields", missing, "are missing; start from sse_jax.train.default_config()")
  for field in ("batch_size", "num_steps", "eval_batches", "log_every", "keep_checkpoints"):
    value = config[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      _fail(field, value, "must be an integer >= 1")
  for field in ("seed", "data_workers", "warmup_steps", "eval_every", "checkpoint_every"):
    value = config[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      _fail(field, value, "must be an integer >= 0")
  if 0 < config.num_steps <= config.warmup_steps:
    _fail("warmup_steps", config.warmup_steps,
          f"must be < num_steps ({config.num_steps}): the run would end inside its "
          "warm-up, before the peak lr, with no cosine decay")
  if not config.lr > 0:
    _fail("lr", config.lr, "must be > 0")
  if not 0 <= config.min_lr_ratio <= 1:
    _fail("min_lr_ratio", config.min_lr_ratio, "must lie in [0, 1]")
  for field in ("weight_decay", "grad_clip", "eps"):
    if not config[field] >= 0:
      _fail(field, config[field], "must be >= 0")
  for field in ("b1", "b2"):
    if not 0 <= config[field] < 1:
      _fail(field, config[field], "must lie in [0, 1)")
  for field in ("compute_dtype", "param_dtype"):
    if config[field] not in DTYPES:
      _fail(field, config[field], f"must be one of {sorted(DTYPES)}")
  mesh = to_dict(config.mesh)
  if set(mesh) != {"data", "model"}:
    _fail("mesh", mesh, "must have exactly the fields data and model")
  if not (mesh["data"] == -1 or mesh["data"] >= 1) or mesh["model"] < 1:
    _fail("mesh", mesh, "needs data >= 1 or -1 (all devices) and model >= 1")
  if "kind" not in to_dict(config.data):
    _fail("data", to_dict(config.data), "needs a `kind` (see sse_jax.data.default_config)")
  pairs = tuple(config.eval_pairs)
  if pairs:
    if any(not isinstance(p, int) or isinstance(p, bool) or p < 1 for p in pairs):
      _fail("eval_pairs", pairs, "must be positive integers (MQAR pair counts)")
    evals = eval_data_config(config)
    if evals["kind"] != "mqar":
      _fail("eval_pairs", pairs, f"needs MQAR evaluation data, not kind {evals['kind']!r}")
    for p in pairs:
      test_config(evals, p)  # raises the MQAR config's own error for an impossible P


def test_config(eval_data: dict, pairs: int) -> dict:
  """The data config of the per-pair-count test set for P = `pairs` (see eval_pairs)."""
  from sse_jax.data import make_source  # pylint: disable=g-import-not-at-top
  out = dict(eval_data, num_pairs=int(pairs), min_pairs=None, split="test")
  if out.get("num_queries") is not None:
    out["num_queries"] = min(out["num_queries"], int(pairs))
  try:
    make_source(out)
  except ValueError as e:
    _fail("eval_pairs", pairs, f"is impossible for the evaluation data: {e}")
  return out


def test_batches(config, test: dict) -> int:
  """Batches of a test set (`test_config`): >= MIN_TEST_ANSWERS answers, >= eval_batches."""
  queries = test["num_queries"] if test.get("num_queries") is not None else test["num_pairs"]
  return max(config.eval_batches, -(-MIN_TEST_ANSWERS // (config.batch_size * queries)))


def data_vocab_size(data_config) -> int:
  """Token ids the data can produce: MQAR's vocab_size, else the 256 byte values."""
  from sse_jax.data import VOCAB_SIZE  # pylint: disable=g-import-not-at-top
  data = to_dict(data_config)
  return int(data["vocab_size"]) if data["kind"] == "mqar" else VOCAB_SIZE


def model_config(config) -> ModelConfig:
  """`ModelConfig.create(**config.model)`, vocab_size None filled in from the data; a
  model vocabulary smaller than the data's is an error (ids would index out of range)."""
  kwargs = to_dict(config.model)
  need = data_vocab_size(config.data)
  if kwargs.get("vocab_size") is None:
    kwargs["vocab_size"] = need
  elif kwargs["vocab_size"] < need:
    _fail("model.vocab_size", kwargs["vocab_size"],
          f"is smaller than the data's vocabulary ({need} ids)")
  return ModelConfig.create(**kwargs)


def eval_data_config(config) -> dict:
  """The evaluation stream's data config (see `default_config`, field eval_data).

  Without `eval_data`, the training config with split="validation"; when the training
  stream already reads the validation split (a missing `split` counts as the kind's
  default split), a seeded kind gets seed + 1, and any other kind is an error: there is
  no held-out stream to derive, and evaluating on the training data must not pass
  silently.
  """
  if config.eval_data is not None:
    return to_dict(config.eval_data)
  from sse_jax.data import pipeline  # pylint: disable=g-import-not-at-top
  data = to_dict(config.data)
  split = data.get("split", pipeline.default_config(data["kind"]).get("split"))
  if split != "validation":
    data["split"] = "validation"
  elif "seed" in pipeline.default_config(data["kind"]):
    data["seed"] = data.get("seed", 0) + 1
  else:
    _fail("eval_data", None, f"cannot be derived: data (kind {data['kind']!r}) already "
          "reads the validation split and has no seed; set eval_data to a held-out "
          "stream")
  return data


def fingerprint(config) -> dict:
  """What a checkpoint must agree with to be resumed: every field outside RUN_CONTROL,
  with the model config resolved (so vocab_size None and its value compare equal)."""
  out = {k: to_dict(v) if hasattr(v, "keys") else v
         for k, v in config.items() if k not in RUN_CONTROL}
  out["model"] = json.loads(json.dumps(to_dict(config.model)))
  out["model"]["vocab_size"] = model_config(config).vocab_size
  return json.loads(json.dumps(out))  # tuples -> lists, as they come back from JSON


def diff(saved: Any, current: Any, prefix: str = "", *, old: str = "in the checkpoint",
         new: str = "now") -> list[str]:
  """Human-readable differences between two JSON-like values, one per leaf; `old` and
  `new` say where each side comes from ("1 in the checkpoint, 2 now")."""
  if isinstance(saved, dict) and isinstance(current, dict):
    out = []
    for key in sorted(set(saved) | set(current)):
      name = f"{prefix}.{key}" if prefix else str(key)
      if key not in saved:
        out.append(f"{name}: absent {old}, {current[key]!r} {new}")
      elif key not in current:
        out.append(f"{name}: {saved[key]!r} {old}, absent {new}")
      else:
        out.extend(diff(saved[key], current[key], name, old=old, new=new))
    return out
  if saved != current:
    return [f"{prefix}: {saved!r} {old}, {current!r} {new}"]
  return []
