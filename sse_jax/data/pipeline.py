"""grain input pipeline and a config-driven source factory.

    default_config(kind) -> ml_collections.ConfigDict   every field of `kind`, with defaults
    make_source(config, split=None) -> source     (__len__ / __getitem__ -> example dict)
    make_dataset(source, *, batch_size, seed, shuffle, num_epochs=None) -> grain.IterDataset

Every source yields the same example format, and `make_dataset` batches it:

    inputs  int32   [B, T]   token ids fed to the model
    targets int32   [B, T]   next-token labels
    weights float32 [B, T]   1 where the loss / accuracy counts, 0 elsewhere

with B = batch_size // jax.process_count() rows per process (batch_size is global).

Config fields for `make_source` (an ml_collections.ConfigDict or any mapping; missing fields
take these defaults, unknown fields are an error so that typos do not pass silently):

  kind="mqar"         vocab_size=8192, num_pairs=16, seq_len=128, num_queries=None (= pairs),
                      gap_mode="none" | "zero" | "noise", gap_len=0, seed=0,
                      num_examples=2**30, split="train" | "validation" | "test"
  kind="shakespeare"  seq_len=256, split="train" | "validation", valid_fraction=0.1,
                      stride=None (= seq_len)
  kind="retrieval"    seq_len=1024, split="validation" | "train" (haystack text),
                      valid_fraction=0.1, num_digits=7, depth=None (random), seed=0,
                      num_examples=256
  kind="tfds"         name="tiny_shakespeare", split="train" (any TFDS split spec),
                      text_key="text", seq_len=256, mode="pack" | "pad", data_dir=None,
                      stride=None

The `split` argument of make_source overrides config.split (handy for one config that
serves both the training and the evaluation stream). For MQAR the split only selects an
independent random stream (train 0, validation 1, test 2 as `split_seed`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

from sse_jax.data.mqar import MQARConfig, MQARSource
from sse_jax.data.retrieval import RetrievalConfig, RetrievalSource
from sse_jax.data.shakespeare import ShakespeareConfig, ShakespeareSource
from sse_jax.data.tfds_source import TfdsConfig, TfdsTextSource

# kind -> (config dataclass, source class). MQAR is special-cased: its split is a seed.
KINDS = {
    "mqar": (MQARConfig, MQARSource),
    "shakespeare": (ShakespeareConfig, ShakespeareSource),
    "retrieval": (RetrievalConfig, RetrievalSource),
    "tfds": (TfdsConfig, TfdsTextSource),
}
MQAR_SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2}


def _fields(config: Any) -> dict[str, Any]:
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
    return dict(config.to_dict())
  if isinstance(config, Mapping):
    return dict(config)
  raise TypeError(f"data config must be a ConfigDict or a mapping, got {type(config).__name__}")


def _build(cls, fields: dict[str, Any], kind: str):
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"unknown field(s) {unknown} for data kind {kind!r}; "
                     f"known: {sorted(known)}")
  return cls(**fields)


def default_config(kind: str):
  """A ConfigDict with `kind` and every field of that kind at its default, to edit in an
  experiment config (e.g. `cfg.data = default_config("mqar"); cfg.data.num_pairs = 64`)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}: must be one of {sorted(KINDS)}")
  fields = {f.name: f.default for f in dataclasses.fields(KINDS[kind][0])}
  if kind == "mqar":
    fields["split"] = "train"
  return ml_collections.ConfigDict({"kind": kind, **fields})


def make_source(config: Any, split: str | None = None):
  """Builds the data source named by `config.kind` (see the module docstring)."""
  fields = _fields(config)
  kind = fields.pop("kind", None)
  if kind not in KINDS:
    raise ValueError(f"data config kind={kind!r}: must be one of {sorted(KINDS)}")
  if split is not None:
    fields["split"] = split
  config_cls, source_cls = KINDS[kind]
  if kind == "mqar":
    split = fields.pop("split", "train")
    if split not in MQAR_SPLIT_SEEDS:
      raise ValueError(f"split={split!r} for mqar: must be one of {tuple(MQAR_SPLIT_SEEDS)}")
    return source_cls(_build(config_cls, fields, kind), MQAR_SPLIT_SEEDS[split])
  return source_cls(_build(config_cls, fields, kind))


def make_dataset(source, *, batch_size: int, seed: int, shuffle: bool,
                 num_epochs: int | None = None, process_index: int | None = None,
                 process_count: int | None = None, num_threads: int = 2,
                 prefetch_buffer_size: int = 8, num_workers: int = 0):
  """grain IterDataset of batches from `source` for this process.

  Steps: per-process shard -> (seeded shuffle) -> repeat num_epochs (None: forever) ->
  batch with drop_remainder -> threaded prefetch (-> `num_workers` worker processes).

  * Sharding: the source is cut to a multiple of process_count and process p takes the
    strided slice p::count, so shards are disjoint and equally long (every process yields
    the same number of batches: no process hangs at the end of a finite epoch).
  * batch_size is the GLOBAL batch: each process yields batch_size // process_count rows.
  * Shuffling is a seeded global permutation of the shard, redrawn every epoch; the result
    is deterministic in (source, seed, process_index, process_count), so a fresh pipeline
    plus a restored iterator state resumes on exactly the same batch.
  * `iter(ds)` supports get_state() -> JSON-able dict and set_state(state); with orbax use
    grain.checkpoint.CheckpointSave / CheckpointRestore. The state holds only a position:
    restoring it into a pipeline built with other arguments does not fail, it silently
    reads other data, so store the data config next to it.
  * num_workers > 0 makes the batches in that many worker processes (grain's
    mp_prefetch): the same batches in the same order, for hosts where one Python thread
    cannot generate them as fast as a small GPU model trains. Its iterator state has
    another format: resume with the same num_workers.
  process_index / process_count default to jax's; set them to simulate other processes.
  """
  try:
    import grain  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ModuleNotFoundError("the data pipeline needs `pip install grain`") from None
  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  if not 0 <= index < count:
    raise ValueError(f"process_index={index} must lie in [0, process_count={count})")
  if batch_size < 1 or batch_size % count:
    raise ValueError(f"batch_size={batch_size} must be a positive multiple of "
                     f"process_count={count} (it is the global batch)")
  if num_epochs is not None and num_epochs < 1:
    raise ValueError(f"num_epochs={num_epochs}: must be >= 1 or None (forever)")
  if not isinstance(num_workers, int) or num_workers < 0:
    raise ValueError(f"num_workers={num_workers!r}: must be an integer >= 0")
  local_batch = batch_size // count

  # The shard / shuffle / repeat / batch steps act on example indices, and a batch of
  # indices is read in one call: grain's per-read bookkeeping on every example cost as
  # much as generating an MQAR example, and a small GPU model waits on its input. The
  # examples are those of the same steps on the source itself.
  ds = grain.MapDataset.range(len(source))
  ds = ds[:len(ds) - len(ds) % count][index::count]
  if num_epochs is not None and len(ds) * num_epochs < local_batch:
    raise ValueError(f"{source!r} gives {len(ds)} examples per process, fewer than one batch "
                     f"of {local_batch} in {num_epochs} epoch(s)")
  if shuffle:
    ds = ds.shuffle(seed=seed)
  if num_epochs != 1:
    ds = ds.repeat(num_epochs)
  ds = ds.batch(local_batch, drop_remainder=True).map(BatchReader(source))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=num_threads,
                                            prefetch_buffer_size=prefetch_buffer_size))
  if num_workers:
    # grain reads one of its absl flags when it starts workers; outside an absl app
    # (a notebook, pytest) nothing has parsed them, so take their defaults.
    from absl import flags  # pylint: disable=g-import-not-at-top
    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=num_workers, per_worker_buffer_size=max(1, prefetch_buffer_size // 2)))
  return ds


class BatchReader:
  """indices int [B] -> the examples source[i], each field stacked: [B, ...]."""

  def __init__(self, source):
    self.source = source

  def __call__(self, indices):
    examples = [self.source[int(i)] for i in indices]
    return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

  def __repr__(self) -> str:
    return f"BatchReader({self.source!r})"
