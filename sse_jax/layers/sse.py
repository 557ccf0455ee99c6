"""The SSE mixer: Sparse State Expansion linear attention (docs/design.md, sections 1-2).

For x [B, T, D], H heads with key dim Dk and value dim Dv:

    e_t  = softmax(x_t W_e)  (float32)                 router over N partitions
    T_t  = TopK(e_t, k)      (weights e_t^i, NOT renormalised)
    q_t  = phi_q(x_t W_q),  k_t = phi_k(x_t W_k),  v_t = phi_v(x_t W_v)   shared W_q/k/v
    g_t  = log_sigmoid(x_t W_g1 W_g2 + b) / 16                           log decay
    S_t^i = diag(exp g_t) S_{t-1}^i + w_t^i k_t^T v_t   if i in T_t  (else S^i unchanged:
                                                        no decay when not selected)
    o_t  = sum_{i in T_t} r_t^i Dk^-1/2 q_t S_t^i  +  Dk^-1/2 q'_t S_t^0
    y_t  = (RMSNorm_head(o_t) * silu(x_t W_gate)) W_o

Gate placement (Table 7): (w, r) = (e, e) "both", (e, 1) "write", (1, e) "read",
(1, 1) "none". With "none" the router's probabilities never multiply anything in the
forward pass and the top-k indices are piecewise constant, so the router gets NO
gradient from the language-model loss: W_e is trained only by the load-balance loss
(through p_i). Separate write and read sets (`num_writers` / `num_readers`, the
official code's) use the top-`num_writers` partitions for T_t in the state update and
the top-`num_readers` for the read; the load-balance loss counts f_i over the write set
(the partitions whose states change).

Shared partition S^0 (always on, weight 1, sharing v). `lora_target`:
  "shared" (paper): q' = phi_q(x W_q + LoRA_q(x)), k' = phi_k(x W_k + LoRA_k(x)); the
     routed partitions use the plain q, k; one decay gate g for all.
  "routed" (official code): the routed partitions use the LoRA-adapted q, k and the
     shared partition the plain ones; the shared partition has its own decay gate.
LoRA_*(x) = x A B with rank `lora_rank` (B zero-initialised, so the two start equal);
rank 0 disables it. The official code's LoRA has rank Dv: with lora_target="routed" set
lora_rank to the head value dim to match it (the default, 64, is the paper's). With a
short conv the LoRA is added after the conv + SiLU, before the feature map. (The paper writes q' = q + LoRA_q(x): identical for the default
identity query map.)

Degenerate cases:
  num_partitions = 1 (top_k = 1): e_t = 1 exactly, so the routed part is one GLA state
    with weight 1 -- without the shared partition and with the GLA mixer's feature
    maps (key_activation="identity") the layer computes exactly the GLA mixer with the
    same parameters (`sse_jax.layers.GLA`); the router gets no
    gradient and the load-balance loss is the constant 1.
  top_k = num_partitions: every partition decays and is written every step; with
    gate "none" the routed output is N times the GLA output of the same q, k, v, g.

share_partition_params=False (Table 8's MoM-like control): W_q, W_k, W_v become
[D, P, H, D*] with P = N (+1 for the shared partition, which then has its own
projections instead of a LoRA; `lora_rank` is unused) and the layer calls `ops.sse`
(and `ops.sse_decode_step`) with per-partition q, k, v [B, T, N, H, D] for whatever
`impl` says, XLA or Pallas (`per_partition`); the decoding cache keeps the partitions
folded into heads, [B, P H, Dk, Dv].

transition="delta" (SSE-GDN, docs/design.md, section 7): every partition is a gated
delta-rule state instead (`ops.sse_gdn`). q and k (routed and shared, after the feature
maps and the LoRA) are L2-normalised; the GLA decay gate is replaced by the official GDN
gates g = -exp(A_log) softplus(x W_a + dt_bias), beta = sigmoid(x W_b) (x 2 with
allow_neg_eigval), one per head, and a selected partition i takes

    S'^i = exp(g_t) S_{t-1}^i,   S_t^i = S'^i + w_t^i beta_t k_t^T (v_t - k_t S'^i)

(unselected: untouched); the read is the same as above. The router weight is thus a
write strength and an output weight, never a factor of q or k. The shared partition is
a GDN state with the shared q', k' and, with lora_target="routed", gates of its own (else
the routed ones). Every other knob applies as written above; per-partition projections
(share_partition_params=False) and the GLA gate fields (gate_rank, gate_normalizer away
from their defaults) are refused.

Cache state (`init_cache`): shared params: routed float32 [B, N, H, Dk, Dv], and
with the shared partition a tuple (routed, shared [B, H, Dk, Dv]) -- the layout of
`ops.sse`; per-partition params: [B, P H, Dk, Dv].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax import ops
from sse_jax.layers import features
from sse_jax.layers import sequences
from sse_jax.layers import validation as check
from sse_jax.layers.delta import (TRANSITIONS, DeltaGates, Transition,
                                  check_unused_gla_gate, l2_normalize)
from sse_jax.layers.linear import LinearAttentionConfig, LinearMixer, OutputHead, QKV
from sse_jax.layers.linear import RecurrentCache
from sse_jax.layers.lowrank import DecayGate, LowRank
from sse_jax.layers.per_partition import per_partition_sse
from sse_jax.layers.router import Router

LORA_TARGETS = ("shared", "routed")


@dataclasses.dataclass(frozen=True)
class SSEConfig(LinearAttentionConfig):
  """SSE mixer config: the `LinearAttentionConfig` fields plus

  impl: one of `ops.SSE_IMPLS` ("chunk" is the dense GLA form, not an SSE impl: the
    masking and varlen impls run it over the partitions).
  num_partitions: N routed partitions. top_k: k selected per token (1 <= k <= N).
  num_writers / num_readers: separate write / read set sizes; None = top_k.
  gate_placement: "both" | "write" | "read" | "none".
  shared_partition: add the always-on shared partition S^0.
  lora_rank / lora_target: the shared-partition LoRA ("shared" paper, "routed"
    official), see the module docstring.
  share_partition_params: one W_q/W_k/W_v for all partitions (the paper) or one per
    partition (Table 8 control).
  transition: "gla" (the paper's SSE) or "delta" (SSE-GDN; impl then one of
    `ops.SSE_GDN_IMPLS`; see the module docstring for what it refuses).
  allow_neg_eigval: delta only: beta = 2 sigmoid(x W_b) in [0, 2].
  Defaults: key_activation "softmax" (paper), impl "varlen".
  """

  key_activation: str = "softmax"
  impl: str = "varlen"
  num_partitions: int = 4
  top_k: int = 1
  num_writers: int | None = None
  num_readers: int | None = None
  gate_placement: str = "both"
  shared_partition: bool = True
  lora_rank: int = 64
  lora_target: str = "shared"
  share_partition_params: bool = True
  transition: str = "gla"
  allow_neg_eigval: bool = False

  @property
  def writers(self) -> int:
    return self.top_k if self.num_writers is None else self.num_writers

  @property
  def readers(self) -> int:
    return self.top_k if self.num_readers is None else self.num_readers

  def kernel_op(self) -> str:
    return "sse_gdn" if self.transition == Transition.DELTA else "sse"

  def allowed_impls(self) -> tuple[str, ...]:
    if self.transition == Transition.DELTA:
      return tuple(ops.SSE_GDN_IMPLS)
    return tuple(i.value for i in ops.SSE_IMPLS)

  def validate(self) -> None:
    name = "SSEConfig"
    check.choice(name, "transition", self.transition, TRANSITIONS)  # picks the impls
    super().validate()
    check.positive_int(name, "num_partitions", self.num_partitions)
    n = self.num_partitions
    for field in ("top_k", "num_writers", "num_readers"):
      value = getattr(self, field)
      check.optional_positive_int(name, field, value)
      if value is not None and value > n:
        check.fail(name, field, value, f"must be <= num_partitions={n}")
    check.choice(name, "gate_placement", self.gate_placement, [g.value for g in ops.Gate])
    check.boolean(name, "shared_partition", self.shared_partition)
    check.nonnegative_int(name, "lora_rank", self.lora_rank)
    check.choice(name, "lora_target", self.lora_target, LORA_TARGETS)
    check.boolean(name, "share_partition_params", self.share_partition_params)
    check.boolean(name, "allow_neg_eigval", self.allow_neg_eigval)
    if self.transition == Transition.GLA:
      if self.allow_neg_eigval:
        check.fail(name, "allow_neg_eigval", True, "applies to transition='delta' only")
      return
    if not self.share_partition_params:
      check.fail(name, "share_partition_params", False, "is not available with "
                 "transition='delta' (ops.sse_gdn takes one W_q/W_k/W_v for all partitions)")
    check_unused_gla_gate(name, self, "to transition='delta'")


class SSE(LinearMixer):
  """SSE mixer: x [B, T, D] -> MixerOutput(y [B, T, D], cache, aux_loss, usage).

  Module docstring for the equations. `dtype` is the compute dtype of projections,
  feature maps and the output (y has it); the router runs in float32 with a float32
  W_e whatever `param_dtype`; recurrent states are float32.
  """

  def __init__(self, config: SSEConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    config.validate()
    self.config = config
    c = config
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.router = Router(c.hidden, c.num_partitions, c.writers, c.readers, rngs=rngs)
    slots = c.num_partitions + int(c.shared_partition)
    self.qkv = QKV(c, copies=None if c.share_partition_params else slots, **kw)
    # decay (GLA: g [B, T, H, Dk]; delta: (g, beta) [B, T, H]); the shared partition
    # has its own with lora_target="routed" (the official code's), else shares it.
    match Transition(c.transition):
      case Transition.GLA:
        gate = lambda: DecayGate(c.hidden, c.gate_rank, c.num_heads, c.head_k,
                                 c.gate_normalizer, **kw)
      case Transition.DELTA:
        gate = lambda: DeltaGates(c.hidden, c.num_heads,
                                  allow_neg_eigval=c.allow_neg_eigval, **kw)
    self.decay = gate()
    self.shared_decay = gate() if c.shared_partition and c.lora_target == "routed" else None
    lora = c.shared_partition and c.lora_rank > 0 and c.share_partition_params
    lowrank = lambda: LowRank(c.hidden, c.lora_rank, c.num_heads, c.head_k, zero_init=True,
                              **kw)
    self.lora_q = lowrank() if lora else None
    self.lora_k = lowrank() if lora else None
    self.out = OutputHead(c, **kw)

  def zero_state(self, batch: int):
    c = self.config
    head = (c.num_heads, c.head_k, c.head_v)
    if not c.share_partition_params:
      slots = c.num_partitions + int(c.shared_partition)
      return jnp.zeros((batch, slots * c.num_heads) + head[1:], jnp.float32)
    routed = jnp.zeros((batch, c.num_partitions) + head, jnp.float32)
    if not c.shared_partition:
      return routed
    return routed, jnp.zeros((batch,) + head, jnp.float32)

  def attend(self, x: jax.Array, cache: RecurrentCache | None = None, cu_seqlens=None):
    """x [B, T, D] -> (o [B, T, H, Dv] before the output head, the updated cache or
    None, the router's `Routing`); cu_seqlens: packed sequences (B == 1) or None."""
    c = self.config
    decode = cache is not None and x.shape[1] == 1
    state = None if cache is None else cache.state
    q, k, v, conv = self.qkv(x, None if cache is None else cache.conv,
                             sequences.positions_or_none(cu_seqlens, x.shape[1]))
    routing = self.router(x)
    g = self.decay(x)
    g0 = g if self.shared_decay is None else self.shared_decay(x)
    if c.share_partition_params:
      o, state = self._shared_params(x, q, k, v, g, g0, routing, state, decode, cu_seqlens)
    else:
      q, k = self._activate_qk(q, k)
      o, state = per_partition_sse(
          q, k, features.activate(c.value_activation, v), g, g0, routing, state,
          num_partitions=c.num_partitions, gate=c.gate_placement,
          shared=c.shared_partition, impl=c.impl, chunk_size=c.chunk_size, decode=decode,
          cu_seqlens=cu_seqlens)
    return o, (None if cache is None else RecurrentCache(state, conv)), routing

  def _activate_qk(self, q, k):
    c = self.config
    return features.activate(c.query_activation, q), features.activate(c.key_activation, k)

  def _shared_params(self, x, q, k, v, g, g0, routing, state, decode, cu_seqlens):
    """The paper's layer: shared W_q/W_k/W_v, one ops.sse / ops.sse_gdn call (or
    decode step). g, g0: the routed and shared decays (`self.decay`'s output)."""
    c = self.config
    v = features.activate(c.value_activation, v)
    q_r, k_r = self._activate_qk(q, k)
    q0 = k0 = None
    if c.shared_partition:
      q0, k0 = q_r, k_r
      if self.lora_q is not None:
        adapted = self._activate_qk(q + self.lora_q(x), k + self.lora_k(x))
        if c.lora_target == "shared":
          q0, k0 = adapted
        else:
          q_r, k_r = adapted
    r = routing
    match Transition(c.transition):
      case Transition.GLA:
        shared = None if q0 is None else (q0, k0, g0)
        step, full, gates = ops.sse_decode_step, ops.sse, (g,)
      case Transition.DELTA:
        # q and k of every partition are unit vectors; g = (g, beta) per head.
        q_r, k_r = l2_normalize(q_r), l2_normalize(k_r)
        shared = None if q0 is None else (l2_normalize(q0), l2_normalize(k0), *g0)
        step, full, gates = ops.sse_gdn_decode_step, ops.sse_gdn, g
    if decode:
      first = lambda z: None if z is None else z[:, 0]
      o, state = step(
          *(first(z) for z in (q_r, k_r, v, *gates, r.write_weights, r.write_indices)),
          state, gate=c.gate_placement, read_weights=first(r.read_weights),
          read_indices=first(r.read_indices),
          shared=None if shared is None else tuple(first(z) for z in shared))
      return o[:, None], state
    return full(q_r, k_r, v, *gates, r.write_weights, r.write_indices,
                num_partitions=c.num_partitions, gate=c.gate_placement,
                initial_state=state, output_final_state=state is not None,
                impl=c.impl, chunk_size=c.chunk_size, shared=shared,
                read_weights=r.read_weights, read_indices=r.read_indices,
                cu_seqlens=cu_seqlens)
