"""flash-linear-attention's GLA entry points (`fla.ops.gla`), for code written against fla.

    o, final_state = chunk_gla(q, k, v, g, scale, initial_state, output_final_state,
                               cu_seqlens)
    o, final_state = fused_recurrent_gla(q, k, v, gk, gv, scale, initial_state,
                                         output_final_state, reverse, cu_seqlens=...)

fla's positional order, defaults and layout: q, k, g [B, T, H, Dk], v [B, T, H, Dv],
initial_state [N, H, Dk, Dv] (N = B, or the number of sequences with cu_seqlens),
scale Dk ** -0.5 by default; both return (o [B, T, H, Dv], final_state or None). They
are `gla` (the chunked and the step-by-step implementation); what fla offers and `gla`
does not (gates on the value dims, reverse order) raises a one-line ValueError.
"""

from __future__ import annotations

import jax.numpy as jnp

from sse_jax.ops.gla import DEFAULT_CHUNK, gla


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, *, impl="chunk", chunk_size: int = DEFAULT_CHUNK):
  """fla's `chunk_gla`: `gla` with impl "chunk" (or `impl`, e.g. "pallas_chunk")."""
  return gla(q, k, v, g, scale=scale, initial_state=initial_state,
             output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl=impl,
             chunk_size=chunk_size)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                        output_final_state=False, reverse=False, *, cu_seqlens=None,
                        state_v_first=False):
  """fla's `fused_recurrent_gla`: `gla` one token at a time (impl "scan").

  gk: the key-dim log decay g ([B, T, H, Dk]); None: no decay (g = 0). fla's value-dim
  gates `gv`, `reverse=True` and `state_v_first=True` are not supported.
  """
  if gv is not None:
    raise ValueError("gv (a log decay over the value dims) is not supported: gla decays "
                     "the key dims only; pass the key-dim gate as gk")
  if reverse:
    raise ValueError("reverse=True is not supported: gla runs forward in time")
  if state_v_first:
    raise ValueError("state_v_first=True is not supported: states are [N, H, Dk, Dv]")
  g = jnp.zeros_like(k) if gk is None else gk
  return gla(q, k, v, g, scale=scale, initial_state=initial_state,
             output_final_state=output_final_state, cu_seqlens=cu_seqlens, impl="scan")
