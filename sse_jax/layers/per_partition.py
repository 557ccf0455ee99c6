"""SSE with per-partition Q/K/V (share_partition_params=False; the MoM-like control
of the paper's Table 8), by masking and folding partitions into heads.

The shared-qkv op cannot express per-partition projections, so this path builds
masked copies itself: for partition i at token t

    q_t^i <- r_t^i q_t^i        (r = read weight, 0 if i is not read)
    k_t^i <- w_t^i k_t^i        (w = write weight, 0 if i is not written)
    g_t^i <- g_t 1[i written]   (g = 0: identity decay -- an unselected partition must
                                 not decay; zeroing k alone would still decay S^i)

plus the always-on shared slot (weights 1, its own decay g0), folds the P = N (+1)
slots into the head axis and makes one `ops.gla` call: o_t = sum_i (masked q_t^i) S_t^i.
Cost ~P x dense GLA, like the "masking" implementation.
"""

from __future__ import annotations

import jax.numpy as jnp

from sse_jax import ops
from sse_jax.layers.gla import run_gla
from sse_jax.layers.router import Routing
from sse_jax.ops.sse import make_routing, spread


def gla_impl(sse_impl: str) -> str:
  """The ops.gla implementation that matches an SSE `impl` string."""
  if sse_impl in ("scan", "auto"):
    return sse_impl
  return "pallas_chunk" if sse_impl.startswith("pallas") else "chunk"


def per_partition_sse(q, k, v, g, g0, routing: Routing, state, *, num_partitions: int,
                      gate: str, shared: bool, impl: str, chunk_size: int, decode: bool,
                      cu_seqlens=None):
  """q, k [B, T, P, H, Dk], v [B, T, P, H, Dv] (slot N = the shared partition when
  `shared`), g, g0 [B, T, H, Dk]; state [B, P H, Dk, Dv] or None; cu_seqlens: packed
  sequences (B == 1) or None.

  Returns (o [B, T, H, Dv], state [B, P H, Dk, Dv] or None). `impl` (an SSE impl) is
  mapped to ops.gla's by `gla_impl`: "scan" -> "scan", "pallas_*" -> "pallas_chunk",
  "auto" -> "auto", others -> "chunk".
  """
  b, t, p, h, _ = q.shape
  n = num_partitions
  r = make_routing(routing.write_weights, routing.write_indices, routing.read_weights,
                   routing.read_indices, ops.Gate(gate))
  written, ww = spread(r.write_idx, r.write_w, n)               # [B, T, N]
  _, rw = spread(r.read_idx, r.read_w, n)
  gs = jnp.broadcast_to(g[:, :, None], (b, t, n) + g.shape[2:])
  written = written.astype(jnp.float32)
  if shared:
    one = jnp.ones((b, t, 1), jnp.float32)
    written, ww, rw = (jnp.concatenate([z, one], axis=2) for z in (written, ww, rw))
    gs = jnp.concatenate([gs, g0[:, :, None]], axis=2)
  col = lambda w: w[..., None, None]
  fold = lambda z: z.reshape(b, t, p * h, z.shape[-1])
  o, state = run_gla(fold(q * col(rw)), fold(k * col(ww)), fold(v), fold(gs * col(written)),
                     state, impl=gla_impl(impl), chunk_size=chunk_size, decode=decode,
                     cu_seqlens=cu_seqlens)
  return o.reshape(b, t, p, h, -1).sum(axis=2).astype(v.dtype), state
