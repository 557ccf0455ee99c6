"""Loss, accuracy and router statistics.

On a batch dict(inputs [B, T], targets [B, T], weights [B, T]) and the model's output:

    ce        = sum_bt w_bt CE(logits_bt, target_bt) / sum_bt w_bt      (nats per token)
    loss      = ce + aux_loss                       (aux_loss: the scaled load-balance loss)
    accuracy  = sum_bt w_bt [argmax logits_bt == target_bt] / sum_bt w_bt
    exact_match = fraction of sequences (with any weight) whose weighted positions are all
                correct (a whole MQAR sequence, or a whole retrieval answer)
    bpb       = ce / ln 2 for byte-level text (one token per byte)

Evaluation sums the numerators and denominators over batches (`eval_sums`) so the
averages are exact whatever the number of batches. Router statistics of an SSE layer
with usage fractions f_i (fraction of tokens writing partition i; sum_i f_i = k):

    entropy   -sum_i p_i log p_i / log N, p = f / sum f   (1 balanced, 0 collapsed)
    max       max_i f_i, the busiest partition's fraction (k / N balanced, 1 collapsed)

(f counts non-PAD tokens only, see `steps.forward`.) On MQAR data, also

    agreement  over the scored answers: the fraction whose value token (where the pair's
               value was written) writes a partition that the query token reads, i.e.
               the state that holds the pair is one the query looks at. A router that
               ignores its input agrees with probability ~ 1 - (1 - Kr / N)^Kw.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sse_jax.data import bits_per_byte, exact_match


def _weighted(out, batch) -> dict[str, jax.Array]:
  """Per-batch sums: weighted CE, weighted correct, weight, exact matches, scored seqs."""
  targets, weights = batch["targets"], batch["weights"]
  ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, targets)  # [B, T]
  correct = jnp.argmax(out.logits, axis=-1) == targets
  return {
      "ce_sum": jnp.sum(weights * ce),
      "correct_sum": jnp.sum(weights * correct),
      "weight_sum": jnp.sum(weights),
      "exact_sum": jnp.sum(exact_match(correct, weights)),
      "scored_sum": jnp.sum(jnp.any(weights > 0, axis=-1)),
  }


def _ratio(num, den):
  return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)


def train_metrics(out, batch) -> dict[str, jax.Array]:
  """Scalars of one training batch; "loss" is what the optimizer minimises."""
  s = _weighted(out, batch)
  ce = _ratio(s["ce_sum"], s["weight_sum"])
  return {"loss": ce + out.aux_loss, "ce": ce, "aux_loss": out.aux_loss,
          "accuracy": _ratio(s["correct_sum"], s["weight_sum"]),
          "exact_match": _ratio(s["exact_sum"], s["scored_sum"])}


def value_positions(inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """For every position t: s(t), the first input position before t holding targets[t]
  (in MQAR, the answer's value token in the key-value pairs), and whether one exists.
  inputs, targets int [B, T] -> (int32 [B, T], bool [B, T])."""
  t = inputs.shape[1]
  same = inputs[:, None, :] == targets[:, :, None]                     # [B, t, s]
  same = same & (jnp.arange(t)[None, :] < jnp.arange(t)[:, None])[None]
  return jnp.argmax(same, axis=-1).astype(jnp.int32), jnp.any(same, axis=-1)


def route_agreement(indices, batch) -> jax.Array:
  """Sum over scored answers of 1[write set at the value token meets the read set at the
  query token] for one SSE layer's (write [B, T, Kw], read [B, T, Kr]) indices."""
  write, read = indices
  pos, found = value_positions(batch["inputs"], batch["targets"])
  written = jnp.take_along_axis(write, pos[..., None], axis=1)           # [B, T, Kw]
  meet = jnp.any(written[..., :, None] == read[..., None, :], axis=(-2, -1))
  return jnp.sum(batch["weights"] * (found & meet))


def eval_sums(out, batch, *, recall: bool = False) -> dict[str, Any]:
  """What one evaluation batch adds: the sums above, aux_loss, router usage [N] per layer
  and, with `recall`, each layer's route agreement sum."""
  sums = {**_weighted(out, batch), "aux_loss": out.aux_loss,
          "router_usage": tuple(out.router_usage)}
  if recall:
    sums["router_agree"] = tuple(route_agreement(i, batch) for i in out.router_indices)
  return sums


def router_stats(usage: Sequence[float]) -> dict[str, Any]:
  """usage, entropy (normalised to [0, 1]) and max of one layer's usage fractions."""
  f = np.asarray(usage, np.float64)
  total = f.sum()
  p = f / total if total > 0 else np.full_like(f, 1.0 / len(f))
  nz = p[p > 0]
  entropy = float(-(nz * np.log(nz)).sum() / math.log(len(f))) if len(f) > 1 else 1.0
  return {"usage": [float(x) for x in f], "entropy": entropy, "max": float(f.max())}


def finish_eval(batches: list[dict], routed_layers: Sequence[int], byte_level: bool
                ) -> dict[str, Any]:
  """Averages of host copies of `eval_sums` over batches (see the module docstring)."""
  total = lambda key: float(sum(float(b[key]) for b in batches))
  weight = total("weight_sum")
  ce = total("ce_sum") / weight if weight else 0.0
  aux = total("aux_loss") / len(batches)
  out = {"loss": ce + aux, "ce": ce, "aux_loss": aux,
         "accuracy": total("correct_sum") / weight if weight else 0.0,
         "exact_match": total("exact_sum") / max(total("scored_sum"), 1.0),
         "tokens_scored": weight, "batches": len(batches)}
  if byte_level:
    out["bpb"] = float(bits_per_byte(ce))
  out["router"] = []
  for i, layer in enumerate(routed_layers):
    usage = np.mean([np.asarray(b["router_usage"][i]) for b in batches], axis=0)
    out["router"].append({"layer": layer, **router_stats(usage)})
    if "router_agree" in batches[0] and weight:
      out["router"][-1]["agreement"] = total_of(batches, "router_agree", i) / weight
  return out


def total_of(batches: list[dict], key: str, i: int) -> float:
  return float(sum(float(b[key][i]) for b in batches))


def flat_scalars(prefix: str, metrics: dict[str, Any]) -> dict[str, float]:
  """{prefix/name: value} of the scalar metrics, router stats as prefix/router_L<i>/..."""
  out = {}
  for key, value in metrics.items():
    if key == "router":
      for layer in value:
        for stat in ("entropy", "max", "agreement"):
          if layer.get(stat) is not None:
            out[f"{prefix}/router_L{layer['layer']}/{stat}"] = layer[stat]
    elif key == "by_pairs":
      for p, m in value.items():
        out[f"{prefix}/accuracy_P{p}"] = float(m["accuracy"])
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      out[f"{prefix}/{key}"] = float(value)
  return out
