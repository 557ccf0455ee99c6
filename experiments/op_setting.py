"""The op benchmarks' setting, shared by `bench_ops` and `profile_kernels` (no flags).

  make_inputs  random inputs shaped like an SSE layer's (Fig. 6 setting)
  time_fn      the timing rule: compile, warm up, median of timed runs under `jit`
  parse_variant  "field=value,..." -> BlockSizes overrides (the tools' --variants flags)
  rel_err      |a - b| / |b| in float64, the tools' error measure
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def make_inputs(length, n, heads, dim, top_k, seed=0, dtype=jnp.bfloat16):
  """Random bf16 inputs shaped like an SSE layer's: softmax keys, GLA-style gates."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 8)
  shape = (1, length, heads, dim)
  q = jax.random.normal(keys[0], shape, dtype)
  k = jax.nn.softmax(jax.random.normal(keys[1], shape, jnp.float32), -1).astype(dtype)
  v = jax.random.normal(keys[2], shape, dtype)
  g = jax.nn.log_sigmoid(jax.random.normal(keys[3], shape, jnp.float32)) / 16
  q0 = jax.random.normal(keys[4], shape, dtype)
  k0 = jax.nn.softmax(jax.random.normal(keys[5], shape, jnp.float32), -1).astype(dtype)
  probs = jax.nn.softmax(jax.random.normal(keys[6], (1, length, n), jnp.float32), -1)
  w, idx = jax.lax.top_k(probs, top_k)
  cot = jax.random.normal(keys[7], (1, length, heads, dim), dtype)
  cu = jnp.asarray([0, length // 2, length], jnp.int32)
  return dict(q=q, k=k, v=v, g=g, q0=q0, k0=k0, w=w, idx=idx, cot=cot, cu=cu)


def delta_inputs(x):
  """The delta-rule inputs derived from make_inputs' dict: L2-normalised keys "kn",
  "k0n", a per-head log decay "gh" [1, L, H] (the GLA gate's first feature) and "beta"
  [1, L, H] = sigmoid(N(0, 1))."""
  unit = lambda a: (a.astype(jnp.float32) / jnp.linalg.norm(
      a.astype(jnp.float32), axis=-1, keepdims=True)).astype(a.dtype)
  beta = jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(11), x["g"].shape[:3]))
  return dict(x, kn=unit(x["k"]), k0n=unit(x["k0"]), gh=x["g"][..., 0], beta=beta)


def time_fn(fn, x, reps, warmup):
  """(median ms of `reps` runs of fn(x), compile + first-run seconds), each run ended
  by `block_until_ready`, after `warmup` untimed runs."""
  t0 = time.perf_counter()
  jax.block_until_ready(fn(x))
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    jax.block_until_ready(fn(x))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), compile_s


def parse_variant(text: str) -> dict[str, int | float | bool]:
  fields = {}
  for item in filter(None, (t.strip() for t in text.split(","))):
    name, _, value = item.partition("=")
    if not value:
      raise ValueError(f"--variants entry {item!r}: expected field=value")
    if value.lower() in ("true", "false"):
      fields[name] = value.lower() == "true"
    else:
      fields[name] = float(value) if "." in value else int(value)
  return fields


def rel_err(a, b) -> float:
  """Relative error |a - b| / |b| (Frobenius norms, in float64)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
