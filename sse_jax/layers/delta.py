"""What the delta-rule mixers share (GDN, SSE with transition="delta", MoM's "delta"):
the transition names, the official Gated DeltaNet gates, the L2 normalisation of
queries and keys, and the GLA decay-gate fields they leave unused (docs/design.md,
section 7).

    g    = -exp(A_log) * softplus(x W_a + dt_bias)     [B, T, H], float32, <= 0
    beta = sigmoid(x W_b)  (x 2 with allow_neg_eigval)  [B, T, H], float32, in [0, 1] / [0, 2]

A_log [H] starts at log A, A ~ U(0, 16) (per-step decays exp(g) from ~1 down to fast
forgetting), dt_bias [H] at softplus^-1(dt), dt log-uniform in [1e-3, 0.1]: the
initialisation of the official layer.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sse_jax.layers import params
from sse_jax.layers import validation as check
from sse_jax.layers.params import Einsum


class Transition(str, enum.Enum):
  """A linear-attention state's update: "gla" S <- diag(exp g) S + k^T v, or "delta" the
  gated delta rule S <- exp(g) S, S <- S + beta k^T (v - k S) (docs/design.md, 1 / 7)."""
  GLA = "gla"
  DELTA = "delta"


TRANSITIONS = tuple(t.value for t in Transition)

# The GLA decay gate's fields (`LinearAttentionConfig`), unused by the delta rule.
GLA_GATE_FIELDS = ("gate_rank", "gate_normalizer")


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2, -1) + eps), computed in float32, in x's dtype."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def uniform_log(lo: float, hi: float):
  """Init of A_log: log A, A ~ U(lo, hi)."""
  return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, lo, hi))


def dt_bias_init(key, shape, dtype, dt_min=1e-3, dt_max=0.1, floor=1e-4):
  """Init of dt_bias: softplus^-1(dt), dt log-uniform in [dt_min, dt_max] (>= floor)."""
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.maximum(jnp.exp(u * (np.log(dt_max) - np.log(dt_min)) + np.log(dt_min)), floor)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def check_unused_gla_gate(owner: str, config, why: str) -> None:
  """Raises for a GLA decay-gate field (gate_rank, gate_normalizer) set away from its
  default on a delta-rule config: it would silently do nothing."""
  defaults = {f.name: f.default for f in dataclasses.fields(config)}
  for field in GLA_GATE_FIELDS:
    if getattr(config, field) != defaults[field]:
      check.fail(owner, field, getattr(config, field), f"does not apply {why}: the delta "
                 "rule's decay is g = -exp(A_log) softplus(x W_a + dt_bias)")


class DeltaGates(nnx.Module):
  """x [B, T, D] -> (g, beta), each float32 [B, T, H] (module docstring).

  W_a, W_b [D, H] in `param_dtype`; A_log and dt_bias [H] always float32 (the decay is
  sensitive to rounding; the official layer keeps them float32 too).
  """

  def __init__(self, hidden: int, heads: int, *, allow_neg_eigval: bool = False,
               rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.allow_neg_eigval = allow_neg_eigval
    self.a_proj = Einsum("btd,dh->bth", (hidden, heads), ("embed", "heads"), **kw)
    self.b_proj = Einsum("btd,dh->bth", (hidden, heads), ("embed", "heads"), **kw)
    self.a_log = params.param(rngs, uniform_log(0.0, 16.0), (heads,), ("heads",),
                              jnp.float32)
    self.dt_bias = params.param(rngs, dt_bias_init, (heads,), ("heads",), jnp.float32)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    a = self.a_proj(x).astype(jnp.float32) + self.dt_bias[...]
    g = -jnp.exp(self.a_log[...]) * jax.nn.softplus(a)
    beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
    return g, (2.0 * beta if self.allow_neg_eigval else beta)
