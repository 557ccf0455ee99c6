"""Helpers for tests of models built from these layers."""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

M = TypeVar("M", bound=nnx.Module)


def randomize_params(module: nnx.Module, seed: int, scale: float = 0.3) -> None:
  """Overwrites every nnx.Param in place with random values, so that equivalence tests
  exercise all parameters (default inits leave LoRA ups, biases and norm scales at
  0 / 1). Vectors (norm scales, biases) become 1 + scale N(0, 1), everything else
  scale N(0, 1). Drawn with numpy: no XLA compilation per parameter shape, which
  dominates small CPU tests."""
  rng = np.random.default_rng(seed)
  state = nnx.state(module, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  new = [jnp.asarray(scale * rng.standard_normal(x.shape) + (1.0 if x.ndim == 1 else 0.0),
                     x.dtype) for x in leaves]
  nnx.update(module, jax.tree.unflatten(treedef, new))


def random_module(factory: Callable[[], M], seed: int = 0, scale: float = 0.3) -> M:
  """`factory()` built abstractly (`nnx.eval_shape`, nothing initialised) and then
  filled by `randomize_params`."""
  module = nnx.eval_shape(factory)
  randomize_params(module, seed, scale)
  return module


def router_margin(probs: jax.Array, top_k: int) -> float:
  """Smallest gap between the k-th and (k+1)-th router probability of any token: an
  equivalence test between two computation orders is only well posed when rounding
  (~1e-6) cannot flip a top-k decision, i.e. when this is well above it."""
  n = probs.shape[-1]
  if top_k >= n:
    return float("inf")
  p = jnp.sort(probs, axis=-1)
  return float(jnp.min(p[..., n - top_k] - p[..., n - top_k - 1]))
