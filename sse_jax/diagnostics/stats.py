"""Per-layer diagnostics accumulated over batches of `trace` output.

    stats = [LayerStats(i, kind) for i, kind in enumerate(kinds)]
    for batch in batches:
      for s, t in zip(stats, traces_of(batch)):
        s.add(t, batch["inputs"] != PAD, batch)
    numbers = [s.result() for s in stats]

Per partition type ("gla", "routed", "shared"; `trace` module) `result` gives

    similarity         mean over states of the mean row cosine (`measures.row_similarity`;
                       one state per sequence, head and, routed, partition)
    similarity_matrix  [Dk][Dk]: the mean over those states of C_ij (for the heatmap)
    entropy            mean over states of the energy entropy
    empty_states       the fraction of states that are all zero (a routed partition no
                       token of the sequence wrote): left out of the two means above
    small_keys         the fraction of written key entries below 1e-5, over non-PAD tokens
    receptive_field    {mean, std, per_head, reaches_start}: per head the mean RF over
                       the non-PAD query tokens among the last 128 (routed: over the
                       partitions each query reads), then mean and std over heads;
                       reaches_start: the fraction of (query, head) whose every row
                       reaches back to the first token (the field is then cut by the
                       sequence, not by the decay)

and for SSE layers on MQAR batches the router's write/read agreement (the metric of
`sse_jax.train.metrics.route_agreement`) with its chance level.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sse_jax.diagnostics import measures
from sse_jax.diagnostics.trace import TYPES, LayerTrace
from sse_jax.train import metrics as metrics_lib


class _Sums:
  """Running sums of one partition type of one layer."""

  def __init__(self):
    self.sim = self.ent = 0.0
    self.sim_n = self.ent_n = self.states = self.empty = 0
    self.cos = self.cos_n = None
    self.small = self.keys = 0
    self.rf = self.rf_n = None
    self.start = 0.0

  def add_states(self, states):
    s = np.asarray(states, np.float64)
    cos = measures.row_cosine(s)
    sim = measures.off_diagonal_mean(cos)
    ent = measures.energy_entropy(s)
    flat = cos.reshape((-1,) + cos.shape[-2:])
    cos_sum, cos_n = np.nansum(flat, axis=0), np.sum(~np.isnan(flat), axis=0)
    if self.cos is None:
      self.cos, self.cos_n = np.zeros_like(cos_sum), np.zeros_like(cos_n)
    self.cos += cos_sum
    self.cos_n += cos_n
    self.sim += float(np.nansum(sim))
    self.sim_n += int(np.sum(~np.isnan(sim)))
    self.ent += float(np.nansum(ent))
    self.ent_n += int(np.sum(~np.isnan(ent)))
    self.states += int(ent.size)
    self.empty += int(np.sum(~np.any(s != 0, axis=(-2, -1))))

  def add_receptive_field(self, rf, query_mask, positions):
    """rf [B, W, H], query_mask bool [B, W], positions int [W] (from 0)."""
    m = np.asarray(query_mask, np.float64)[..., None]
    total = np.sum(rf * m, axis=(0, 1))                                 # [H]
    count = np.broadcast_to(np.sum(m, axis=(0, 1)), total.shape)
    whole = np.isclose(rf, np.asarray(positions)[None, :, None] + 1)
    self.start += float(np.sum(whole * m))
    if self.rf is None:
      self.rf, self.rf_n = np.zeros_like(total), np.zeros_like(count)
    self.rf += total
    self.rf_n += count

  def result(self) -> dict[str, Any]:
    ratio = lambda a, b: float(a / b) if b else None
    per_head = (self.rf / np.maximum(self.rf_n, 1)).tolist() if self.rf_n.any() else []
    matrix = np.where(self.cos_n > 0, self.cos / np.maximum(self.cos_n, 1), np.nan)
    return {
        "similarity": ratio(self.sim, self.sim_n),
        "similarity_matrix": [[None if np.isnan(x) else round(float(x), 4) for x in row]
                              for row in matrix],
        "entropy": ratio(self.ent, self.ent_n),
        "empty_states": ratio(self.empty, self.states),
        "small_keys": ratio(self.small, self.keys),
        "receptive_field": {"mean": float(np.mean(per_head)) if per_head else None,
                            "std": float(np.std(per_head)) if per_head else None,
                            "per_head": [float(x) for x in per_head],
                            "reaches_start": ratio(self.start, self.rf_n.sum())},
    }


class LayerStats:
  """Accumulates the diagnostics of layer `layer` (`mixer`: "gla", "sse" or
  "attention"; an attention layer has none) over batches."""

  def __init__(self, layer: int, mixer: str, *, window: int = measures.WINDOW,
               threshold: float = measures.DECAY_THRESHOLD,
               small: float = measures.SMALL_KEY):
    self.layer, self.mixer = layer, mixer
    self.window, self.threshold, self.small = window, threshold, small
    self.sums: dict[str, _Sums] = {}
    self.agree = self.answers = 0.0
    self.sets = None  # (N, Kw, Kr)

  def add(self, tr: LayerTrace | None, token_mask, batch: dict | None = None) -> None:
    """One batch: `tr` from `trace`, token_mask bool [B, T] (the non-PAD tokens), and
    with `batch` (MQAR inputs / targets / weights [B, T]) the route agreement."""
    if tr is None:
      return
    token_mask = np.asarray(token_mask, bool)
    for kind in TYPES:
      if kind not in tr.states:
        continue
      sums = self.sums.setdefault(kind, _Sums())
      sums.add_states(tr.states[kind])
      small, total = measures.small_key_counts(tr.keys[kind], token_mask, self.small)
      sums.small += small
      sums.keys += total
      rf = measures.receptive_field(tr.log_decay[kind], threshold=self.threshold,
                                    window=self.window)
      t, w = token_mask.shape[1], rf.shape[1]
      if kind == "routed":  # [B, W, N, H]: the partitions each query reads
        reads = np.asarray(tr.read_indices)[:, -w:, :, None]
        rf = np.take_along_axis(rf, reads, axis=2).mean(axis=2)
      sums.add_receptive_field(rf, token_mask[:, -w:], np.arange(t - w, t))
    if tr.write_indices is not None:
      self.sets = (tr.states["routed"].shape[1], tr.write_indices.shape[-1],
                   tr.read_indices.shape[-1])
      if batch is not None:
        agree = metrics_lib.route_agreement((tr.write_indices, tr.read_indices), batch)
        self.agree += float(agree)
        self.answers += float(np.sum(batch["weights"]))

  def result(self) -> dict[str, Any]:
    """{layer, mixer, types: {type: numbers (module docstring)}} and, for SSE layers,
    agreement (None without MQAR answers), agreement_chance and answers."""
    out = {"layer": self.layer, "mixer": self.mixer,
           "types": {kind: s.result() for kind, s in self.sums.items()}}
    if self.sets is not None:
      out["agreement"] = self.agree / self.answers if self.answers else None
      out["agreement_chance"] = measures.agreement_chance(*self.sets)
      out["answers"] = int(self.answers)
    return out
