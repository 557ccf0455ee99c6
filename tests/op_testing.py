"""Shared helpers for op tests: random inputs, routings, and error metrics."""

from __future__ import annotations

import collections
import contextlib
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@contextlib.contextmanager
def x64():
  """Enables float64 for the duration of a test, then restores the setting."""
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", prev)


def rel_err(a, b) -> float:
  """||a - b|| / ||b|| in float64 (0 when both are zero)."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  assert np.all(np.isfinite(a)), "non-finite values"
  den = np.linalg.norm(b)
  num = np.linalg.norm(a - b)
  return float(num / den) if den > 0 else float(num)


def assert_close(a, b, tol: float, what: str = "") -> None:
  err = rel_err(a, b)
  assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


class Inputs(NamedTuple):
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array


def random_qkvg(key, b, t, h, dk, dv, dtype=jnp.float32, decay=1.0) -> Inputs:
  """Random q, k, v and a log decay g = -decay * |N(0,1)|, roughly like a GLA gate."""
  kq, kk, kv, kg = jax.random.split(key, 4)
  q = jax.random.normal(kq, (b, t, h, dk), dtype)
  k = jax.random.normal(kk, (b, t, h, dk), dtype)
  v = jax.random.normal(kv, (b, t, h, dv), dtype)
  g = (-decay * jnp.abs(jax.random.normal(kg, (b, t, h, dk)))).astype(dtype)
  return Inputs(q, k, v, g)


def random_routing(key, b, t, n, top_k, dtype=jnp.float32, mode="random"):
  """(weights [B, T, K], indices int32 [B, T, K]) from a random router.

  mode: "random" (softmax top-k of random logits), "one" (every token routed to the
  same K partitions 0..K-1), "skip_last" (partition N-1 is never selected).
  """
  logits = jax.random.normal(key, (b, t, n), jnp.float32)
  if mode == "one":
    logits = logits + 100.0 * (jnp.arange(n) < top_k)
  elif mode == "skip_last":
    logits = logits.at[..., n - 1].set(-1e9)
  elif mode != "random":
    raise ValueError(mode)
  probs = jax.nn.softmax(logits, axis=-1)
  weights, indices = jax.lax.top_k(probs, top_k)
  return weights.astype(dtype), indices.astype(jnp.int32)


def cuda_triton_kernels(fn, *args) -> collections.Counter:
  """{kernel name: number of calls} of the Triton kernels in jit(fn)(*args) lowered for
  CUDA (on any host); the lowering itself is the check that Triton accepts the compiled
  (non-interpret) kernels."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = [line for line in text.splitlines()
           if "__gpu$xla.gpu.triton" in line or "triton_kernel_call" in line]
  names = [re.search(r'name = "([^"]*)"', line) for line in calls]
  return collections.Counter(m.group(1) if m else "?" for m in names)


def cuda_triton_calls(fn, *args) -> int:
  """Number of Triton kernel calls in jit(fn)(*args) lowered for CUDA other than the
  packing's row moves (`pallas_kernels.move_rows`, counted by `cuda_triton_kernels`)."""
  counts = cuda_triton_kernels(fn, *args)
  return sum(n for name, n in counts.items() if name != "move_rows")
