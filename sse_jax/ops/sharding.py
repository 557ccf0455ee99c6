"""Run the ops per device shard when a mesh is active, so routing stays local.

XLA cannot partition the varlen packing (a sort and gathers over the flattened batch)
or a `pallas_call`: under a sharded `jit` it would all-gather the activations. The ops
therefore run inside `jax.shard_map` over the batch axis (and the head axis, when it
divides H) of the context mesh: each device packs and processes its own sequences and
heads, with no cross-device traffic. The recurrences are independent across batch
elements and heads, so this is exact.

The context mesh is the one set with `jax.set_mesh(mesh)` (or `jax.sharding.use_mesh`)
around tracing. Axis names looked up: BATCH_AXES for B, HEAD_AXES for H.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
HEAD_AXES = ("model",)


def shard_axes(batch: int, heads: int):
  """(batch axes, head axes) of the context mesh that evenly divide B and H.

  Returns None when there is no context mesh or no axis applies.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))

  def pick(names, dim):
    chosen = tuple(n for n in names if n in sizes and sizes[n] > 1)
    return chosen if chosen and dim % math.prod(sizes[n] for n in chosen) == 0 else ()

  b_axes, h_axes = pick(BATCH_AXES, batch), pick(HEAD_AXES, heads)
  if not b_axes and not h_axes:
    return None
  return b_axes or None, h_axes or None


def per_shard(fn: Callable, args: tuple, specs: tuple, out_specs) -> object:
  """`fn(*args)` under `jax.shard_map` with the given PartitionSpecs.

  check_vma=False: Pallas kernels (in interpret mode especially) do not carry
  varying-manual-axes types.
  """
  return jax.shard_map(fn, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)


def spec(axes, ndim: int, batch_dim: int = 0, head_dim: int | None = None) -> P:
  """PartitionSpec of an array whose batch (and head) dimension is sharded."""
  b_axes, h_axes = axes
  parts = [None] * ndim
  parts[batch_dim] = b_axes
  if head_dim is not None:
    parts[head_dim] = h_axes
  return P(*parts)
