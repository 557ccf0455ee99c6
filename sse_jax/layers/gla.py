"""The GLA mixer: the dense baseline, i.e. the SSE layer with N = 1 and no routing.

    q = phi_q(x W_q), k = phi_k(x W_k), v = phi_v(x W_v)   [B, T, H, Dk / Dv]
    g = log_sigmoid(x W_g1 W_g2 + b) / 16                  [B, T, H, Dk]
    m = features.row_mask(phi_k, x W_k)  (row-sparse phi_k), else all 1   [B, T, H, Dk]
    S_t = diag(exp(m_t g_t)) S_{t-1} + k_t^T v_t,   o_t = Dk^-1/2 q_t S_t   (ops.gla)
    y = (RMSNorm_head(o) * silu(x W_gate)) W_o             [B, T, D]

(optionally with a short conv on the projections, see `LinearAttentionConfig`).
With a dense key map m = 1 and this is plain GLA. With the row-sparse "topk-softmax"
keys it is the paper's row-sparse GLA (Eq. (7)-(8), Appendix A, Fig. 9): a row outside
the key's top-k has m_t[i] = 0 and k_t[i] = 0, so S_t[i] = S_{t-1}[i] (identity: no
decay, no write), and only the selected rows decay and are written.

Its parameters have the same names and shapes as the SSE mixer's minus the router, so
an SSE layer with num_partitions = 1, top_k = 1, no shared partition and the same dense
feature maps (SSE's default keys are softmax, this mixer's identity: set
key_activation="identity" on the SSE side) computes the same function (its router
probability is exactly 1). With "topk-softmax" keys they differ: the SSE mixer decays
every row of a written partition.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax import ops
from sse_jax.layers import features
from sse_jax.layers import sequences
from sse_jax.layers.linear import LinearAttentionConfig, LinearMixer, OutputHead, QKV
from sse_jax.layers.linear import RecurrentCache
from sse_jax.layers.lowrank import DecayGate


@dataclasses.dataclass(frozen=True)
class GLAConfig(LinearAttentionConfig):
  """GLA mixer config (fields in `LinearAttentionConfig`); fla GLA defaults: identity
  feature maps, `impl` "chunk" (or "scan", the reference)."""

  def allowed_impls(self) -> tuple[str, ...]:
    return tuple(i.value for i in ops.GLA_IMPLS)


def run_gla(q, k, v, g, state, *, impl: str, chunk_size: int, decode: bool,
            cu_seqlens=None):
  """ops.gla over [B, T, H, D] inputs (packed sequences with `cu_seqlens`), or one
  decode step when `decode` (T == 1).

  `state` None: a fresh sequence, no final state returned. Returns (o, state or None).
  """
  if decode:
    o, state = ops.gla_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], state)
    return o[:, None], state
  return ops.gla(q, k, v, g, initial_state=state, output_final_state=state is not None,
                 impl=impl, chunk_size=chunk_size, cu_seqlens=cu_seqlens)


class GLA(LinearMixer):
  """GLA mixer: x [B, T, D] -> MixerOutput(y [B, T, D], cache).

  Cache state: float32 [B, H, Dk, Dv].
  """

  def __init__(self, config: GLAConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    config.validate()
    self.config = config
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    c = config
    self.qkv = QKV(c, **kw)
    self.decay = DecayGate(c.hidden, c.gate_rank, c.num_heads, c.head_k, c.gate_normalizer,
                           **kw)
    self.out = OutputHead(c, **kw)

  def zero_state(self, batch: int) -> jax.Array:
    c = self.config
    return jnp.zeros((batch, c.num_heads, c.head_k, c.head_v), jnp.float32)

  def inputs(self, x: jax.Array, conv_state=None, positions=None):
    """x [B, T, D] -> (q, k [B, T, H, Dk], v [B, T, H, Dv] after the feature maps, the
    log decay g [B, T, H, Dk] the state rows take (row mask applied), the new conv state
    or None): what the recurrence reads (`attend`; also the state diagnostics)."""
    c = self.config
    q, k, v, conv = self.qkv(x, conv_state, positions)
    g = self.decay(x)
    keep = features.row_mask(c.key_activation, k)
    if keep is not None:
      # Eq. (8): a row outside the key's top-k keeps its state (log decay 0); its key
      # entry is 0, so nothing is written either. Every path (full, chunked prefill,
      # decode step) takes this g, so they agree.
      g = jnp.where(keep, g, 0.0)
    q = features.activate(c.query_activation, q)
    k = features.activate(c.key_activation, k)
    v = features.activate(c.value_activation, v)
    return q, k, v, g, conv

  def attend(self, x: jax.Array, cache: RecurrentCache | None = None, cu_seqlens=None):
    """x [B, T, D] -> (o [B, T, H, Dv] before the output head, the updated cache or
    None, None: no routing)."""
    c = self.config
    q, k, v, g, conv = self.inputs(x, None if cache is None else cache.conv,
                                   sequences.positions_or_none(cu_seqlens, x.shape[1]))
    state = None if cache is None else cache.state
    o, state = run_gla(q, k, v, g, state, impl=c.impl, chunk_size=c.chunk_size,
                       decode=cache is not None and x.shape[1] == 1, cu_seqlens=cu_seqlens)
    return o, (None if cache is None else RecurrentCache(state, conv)), None
