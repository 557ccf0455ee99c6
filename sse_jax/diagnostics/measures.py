"""The state diagnostics as functions over arrays (docs/design.md, "State
diagnostics").

A state S is [..., Dk, Dv]: row S_i in R^Dv belongs to key dim i. Keys are [..., Dk],
log decays g [B, T, ..., Dk] (g <= 0; g = 0 leaves the row alone at that step).

    row similarity     C_ij = <S_i, S_j> / (|S_i| |S_j|)   over the rows with |S_i| > 0
                       sim(S) = mean_{i != j} C_ij          (NaN with < 2 nonzero rows)
    energy entropy     p_i = sigma_i^2 / sum_j sigma_j^2   (n = min(Dk, Dv) singular values)
                       H(S) = -(1 / log n) sum_i p_i log p_i   in [0, 1]: 0 for rank one,
                       1 for equal energy in every direction (NaN for S = 0, 0 when n = 1)
    small keys         the fraction of key entries with |k| < 1e-5
    receptive field    A_d(j, t) = exp(sum_{u=j+1}^{t} g_{u,d}): what is left at step t
                       of a write made at step j <= t into row d;
                       RF_d(t) = #{j <= t : A_d(j, t) >= 1e-3} (t itself included; as
                       g <= 0 these are the last RF_d(t) tokens), RF(t) = mean_d RF_d(t),
                       for the last min(128, T) query positions t
    agreement chance   1 - C(N - Kw, Kr) / C(N, Kr): the probability that a random write
                       set of Kw partitions meets a random read set of Kr

Everything but the receptive field is numpy in float64; the receptive field runs a
jitted binary search per series.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

SMALL_KEY = 1e-5
DECAY_THRESHOLD = 1e-3
WINDOW = 128


def row_cosine(states) -> np.ndarray:
  """states [..., Dk, Dv] -> C [..., Dk, Dk], the cosine similarity of every pair of
  rows; NaN where either row is zero."""
  s = np.asarray(states, np.float64)
  norm = np.linalg.norm(s, axis=-1)
  unit = s / np.where(norm > 0, norm, 1.0)[..., None]
  cos = np.clip(unit @ np.swapaxes(unit, -1, -2), -1.0, 1.0)
  zero = norm == 0
  return np.where(zero[..., :, None] | zero[..., None, :], np.nan, cos)


def off_diagonal_mean(cos) -> np.ndarray:
  """C [..., Dk, Dk] -> [...]: the mean of C_ij over i != j, NaN entries left out
  (NaN when none is left)."""
  c = np.asarray(cos, np.float64)
  off = np.where(np.eye(c.shape[-1], dtype=bool), np.nan, c)
  count = np.sum(~np.isnan(off), axis=(-2, -1))
  total = np.nansum(off, axis=(-2, -1))
  return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def row_similarity(states) -> np.ndarray:
  """states [..., Dk, Dv] -> [...]: the mean cosine similarity between distinct
  nonzero rows of each state (1: all rows point the same way, 0: orthogonal rows)."""
  return off_diagonal_mean(row_cosine(states))


def energy_entropy(states) -> np.ndarray:
  """states [..., Dk, Dv] -> [...]: H = -(1 / log n) sum_i p_i log p_i with
  p_i = sigma_i^2 / sum_j sigma_j^2 over the n = min(Dk, Dv) singular values, in [0, 1]
  (0: rank one; 1: every direction carries the same energy). NaN for an all-zero state;
  0 when n = 1."""
  s = np.asarray(states, np.float64)
  sigma = np.linalg.svd(s, compute_uv=False)
  energy = sigma ** 2
  total = energy.sum(axis=-1, keepdims=True)
  p = energy / np.where(total > 0, total, 1.0)
  plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=-1)
  n = sigma.shape[-1]
  h = -plogp / math.log(n) if n > 1 else np.zeros_like(plogp)
  return np.where(total[..., 0] > 0, np.clip(h, 0.0, 1.0), np.nan)


def small_key_counts(keys, token_mask=None, threshold: float = SMALL_KEY
                     ) -> tuple[int, int]:
  """keys [B, T, ..., Dk], token_mask bool [B, T] (None: every token) -> (entries with
  |k| < threshold, entries) over the tokens of the mask."""
  k = np.abs(np.asarray(keys, np.float32))
  small = k < threshold
  if token_mask is None:
    return int(small.sum()), int(small.size)
  m = np.asarray(token_mask, bool).reshape(small.shape[:2] + (1,) * (small.ndim - 2))
  per_token = int(np.prod(small.shape[2:]))
  return int((small & m).sum()), int(m.sum()) * per_token


def small_key_fraction(keys, token_mask=None, threshold: float = SMALL_KEY) -> float:
  """The fraction of key entries |k| < threshold (see `small_key_counts`); NaN for no
  entries."""
  small, total = small_key_counts(keys, token_mask, threshold)
  return small / total if total else float("nan")


@functools.partial(jax.jit, static_argnames=("window",))
def _receptive_field(log_decay, limit, *, window: int):
  t = log_decay.shape[1]
  rest = log_decay.shape[2:]
  # s_t = -sum_{u <= t} g_u is non-decreasing, and A(j, t) = exp(s_j - s_t): token j
  # counts when s_j >= s_t - limit, i.e. it is not among the first `searchsorted`.
  s = -jnp.cumsum(log_decay.astype(jnp.float32), axis=1)
  series = jnp.moveaxis(s, 1, -1).reshape(-1, t)
  queries = jnp.arange(t - window, t)

  def one(x):
    return queries + 1 - jnp.searchsorted(x, x[queries] - limit, side="left")

  rf = jax.vmap(one)(series).reshape((log_decay.shape[0],) + rest + (window,))
  return jnp.moveaxis(rf, -1, 1).astype(jnp.float32).mean(axis=-1)


def receptive_field(log_decay, *, threshold: float = DECAY_THRESHOLD,
                    window: int = WINDOW) -> np.ndarray:
  """log_decay [B, T, ..., Dk] (finite, <= 0: the log decay each state row takes at each
  step) -> RF [B, W, ...] for the last W = min(window, T) query positions: the number of
  tokens j <= t whose write keeps at least `threshold` of its size at t, per row, averaged
  over the Dk rows (module docstring). RF(t) is between 1 and t + 1 (t from 0)."""
  g = jnp.asarray(log_decay)
  if g.ndim < 3:
    raise ValueError(f"log_decay must be [B, T, ..., Dk], got shape {g.shape}")
  if not 0 < threshold < 1:
    raise ValueError(f"threshold={threshold!r} must be in (0, 1)")
  w = min(int(window), g.shape[1])
  return np.asarray(_receptive_field(g, -math.log(threshold), window=w))


def agreement_chance(num_partitions: int, writers: int, readers: int) -> float:
  """1 - C(N - Kw, Kr) / C(N, Kr): how often a uniformly random write set of Kw
  partitions meets an independent random read set of Kr (a router that ignores its
  input)."""
  n = int(num_partitions)
  return 1.0 - math.comb(n - writers, readers) / math.comb(n, readers)
