"""The MoM mixer: Mixture-of-Memories linear attention, in the style of fla's
`MomAttention` (docs/design.md, section 8).

For x [B, T, D], H heads, N routed memories of which each token picks k, and an
optional shared memory (index N) that every token uses:

    p_t   = softmax(x_t W_r)  (float32)                  router over the N memories
    T_t   = TopK(p_t, k),  w_t^i = p_t^i / sum_{j in T_t} p_t^j      (renormalised)
    q_t   = x_t W_q                                      one query projection
    k_t^i = x_t W_k^i,  v_t^i = x_t W_v^i,  gates of x_t with memory i's own weights

Memory i sees only the tokens routed to it, in order: its short convolution (one
kernel per q / k / v, shared by the memories) runs over that stream, the feature maps
follow, and its state changes only at those tokens ("its clock stops" otherwise):

    gla:    S^i <- diag(exp g^i_t) S^i + k^T v,       g = log_sigmoid(x W_1^i W_2^i + b^i) / 16
    delta:  S^i <- exp(g^i_t) S^i,  S^i <- S^i + beta^i_t k^T (v - k S^i)   (q, k L2-normalised;
            g = -exp(A) softplus(x W_a^i + dt_bias) per head, beta = sigmoid(x W_b^i))

    o_t = sum_{i in T_t} w_t^i scale q_t^i S_t^i  +  scale q_t^N S_t^N      (scale = Dk^-1/2)
    y_t = (RMSNorm_head(o_t) * silu(x_t W_gate)) W_o

where q_t^i is q_t after memory i's stream's short conv. Unlike SSE (whose partitions
share W_k, W_v and weight writes by the router), a memory's keys and values are its own
and the router weights only the read. With k = 1 the weight is exactly 1, so the router
learns from the load-balance loss alone (as in fla). The load-balance loss and usage are
SSE's, over the top-k set.

Computation (every path the same function): each token becomes k routed "slots" and,
with the shared memory, one more. Slots are sorted memory-major into (memory, sequence)
segments, keeping time order inside each; the per-memory projections are one
`jax.lax.ragged_dot` per weight over the sorted slots (a token pays for its k + 1
memories only), the short convs run per segment, and one `ops.gla` (or gated delta rule,
`ops.gdn`) call with the segments as packed sequences (`cu_seqlens`) runs every memory.
A decode step (T == 1 with a cache) gathers the selected memories' states and takes one
step on them. Packed input sequences (`cu_seqlens`) make (memory, input sequence)
segments: no state crosses a sequence boundary.

Cache (`init_cache`): RecurrentCache(state float32 [B, M, H, Dk, Dv], conv (q, k, v)
states [B, M, w - 1, H, D*] or None), M = N + 1 with the shared memory (else N).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sse_jax import ops
from sse_jax.layers import features
from sse_jax.layers import params
from sse_jax.layers.delta import TRANSITIONS, dt_bias_init, l2_normalize, uniform_log
from sse_jax.layers import validation as check
from sse_jax.layers.linear import LinearAttentionConfig, LinearMixer, OutputHead
from sse_jax.layers.linear import RecurrentCache
from sse_jax.layers.params import Einsum
from sse_jax.layers.router import Router, Routing
from sse_jax.layers.short_conv import ShortConv
from sse_jax.ops import packing
from sse_jax.ops import reference
from sse_jax.ops.gdn import GDN_IMPLS, gdn, gdn_decode_step


@dataclasses.dataclass(frozen=True)
class MoMConfig(LinearAttentionConfig):
  """MoM mixer config: the `LinearAttentionConfig` fields plus

  num_memories: N routed memories. top_k: k memories per token (1 <= k <= N).
  shared_memory: add the always-on shared memory (its own W_k, W_v, gates).
  transition: "gla" (gated linear attention, the GLA decay gate per memory) or
    "delta" (the gated delta rule, fla's MoM default).
  impl: `ops.gla`'s implementations for "gla", `ops.gdn`'s for "delta".
  """

  num_memories: int = 4
  top_k: int = 1
  shared_memory: bool = True
  transition: str = "gla"

  @property
  def memories(self) -> int:
    """M: the memories with parameters of their own (routed, then the shared one)."""
    return self.num_memories + int(self.shared_memory)

  def kernel_op(self) -> str:
    return "gdn" if self.transition == "delta" else "gla"

  def allowed_impls(self) -> tuple[str, ...]:
    if self.transition == "delta":
      return GDN_IMPLS
    return tuple(i.value for i in ops.GLA_IMPLS)

  def validate(self) -> None:
    name = "MoMConfig"
    check.choice(name, "transition", self.transition, TRANSITIONS)  # picks the impls
    super().validate()
    check.positive_int(name, "num_memories", self.num_memories)
    check.positive_int(name, "top_k", self.top_k)
    if self.top_k > self.num_memories:
      check.fail(name, "top_k", self.top_k, f"must be <= num_memories={self.num_memories}")
    check.boolean(name, "shared_memory", self.shared_memory)


class Grouped(nnx.Module):
  """Per-memory projection: slots x [P, D_in] sorted by memory, group_sizes [M] ->
  [P, *F], the slots of memory i times its kernel W^i (kernel [M, D_in, *F])."""

  def __init__(self, memories: int, d_in: int, feats: Sequence[int],
               names: Sequence[str], *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32, init=params.default_init):
    self.dtype = dtype
    self.feats = tuple(feats)
    self.kernel = params.param(rngs, init, (memories, d_in) + self.feats,
                               ("partitions",) + tuple(names), param_dtype)

  def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    w = self.kernel[...].astype(self.dtype)
    y = jax.lax.ragged_dot(x.astype(self.dtype), w.reshape(w.shape[:2] + (-1,)),
                           group_sizes)
    return y.reshape(x.shape[:1] + self.feats)


class Slots(NamedTuple):
  """The sorted slots of one call (P = B T k routed slots, then B T shared ones).

  rows [B T k]: the sorted position of each routed slot (token-major order).
  memory, segment, rank [P]: each sorted slot's memory, segment (memory * S + sequence)
    and position in its segment. seg_len [Z = M S]: slots per segment.
  group_sizes [M]: slots per memory. cu_seqlens [Z + 1]: segment boundaries.
  """

  rows: jax.Array
  memory: jax.Array
  segment: jax.Array
  rank: jax.Array
  seg_len: jax.Array
  group_sizes: jax.Array
  cu_seqlens: jax.Array


def make_slots(indices: jax.Array, seq: jax.Array, num_seqs: int, num_memories: int,
               shared: bool) -> Slots:
  """Slots for top-k indices int [B, T, k] and each token's sequence seq int [B T]."""
  n, s = num_memories, num_seqs
  k = indices.shape[-1]
  mem = indices.reshape(-1).astype(jnp.int32)
  routed = mem.shape[0]
  seg = mem * s + jnp.repeat(seq, k)
  # token-major slots: a stable sort keeps time order inside each segment
  order = jnp.argsort(seg, stable=True)
  rows = jnp.zeros((routed,), jnp.int32).at[order].set(jnp.arange(routed, dtype=jnp.int32))
  mem, seg = mem[order], seg[order]
  if shared:  # the shared memory's slots come last, already in segment order
    mem = jnp.concatenate([mem, jnp.full(seq.shape, n, jnp.int32)])
    seg = jnp.concatenate([seg, n * s + seq])
  m = n + int(shared)
  seg_len = jnp.zeros((m * s,), jnp.int32).at[seg].add(1)
  ends = jnp.cumsum(seg_len)
  rank = jnp.arange(seg.shape[0], dtype=jnp.int32) - (ends - seg_len)[seg]
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]).astype(jnp.int32)
  return Slots(rows, mem, seg, rank, seg_len, seg_len.reshape(m, s).sum(axis=1), cu)


def segment_conv(kernel: jax.Array, x: jax.Array, slots: Slots, state: jax.Array):
  """`ShortConv`'s causal conv + SiLU over each segment's own stream of sorted slots.

  kernel [w, *F]; x [P, *F]; state [Z, w - 1, *F]: the last w - 1 inputs of each
  segment before this call (zeros for a fresh one). Returns (y [P, *F], the new state).
  """
  width = kernel.shape[0]
  p, z, hist = x.shape[0], state.shape[0], width - 1
  ext = jnp.concatenate([x, state.astype(x.dtype).reshape((z * hist,) + x.shape[1:])])
  slot = jnp.arange(p, dtype=jnp.int32)
  seg, rank = slots.segment, slots.rank
  y = 0
  for j in range(width):  # tap j reads the input back = w - 1 - j steps back
    back = hist - j
    src = jnp.where(rank >= back, slot - back, p + seg * hist + (hist - back) + rank)
    y = y + kernel[j].astype(x.dtype) * jnp.take(ext, src, axis=0)
  # The new state: the last w - 1 inputs of each stream (older ones from the old state).
  seg_len = slots.seg_len[:, None]
  u = jnp.arange(hist, dtype=jnp.int32)[None]
  at = seg_len - hist + u                                              # [Z, w - 1]
  start = (slots.cu_seqlens[:-1])[:, None]
  src = jnp.where(at >= 0, start + at,
                  p + jnp.arange(z, dtype=jnp.int32)[:, None] * hist + seg_len + u)
  new = jnp.take(ext, src.reshape(-1), axis=0).reshape(state.shape)
  return jax.nn.silu(y), new


class MoM(LinearMixer):
  """MoM mixer: x [B, T, D] -> MixerOutput(y [B, T, D], cache, aux_loss, usage, indices).

  Module docstring for the equations. The per-memory parameters (`PER_MEMORY`) have a
  leading memory axis M (routed memories 0..N-1, then the shared one), of which a token
  uses k + 1 (`sse_jax.model.counting`). Router in float32; recurrent states float32.
  """

  # the parameters stacked over the M memories (leading axis), by attribute name
  PER_MEMORY = ("k_proj", "v_proj", "gate_down", "gate_up", "gate_bias", "decay_proj",
                "beta_proj")

  def __init__(self, config: MoMConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
               param_dtype=jnp.float32):
    config.validate()
    self.config = config
    c = config
    d, h, dk, dv, m = c.hidden, c.num_heads, c.head_k, c.head_v, c.memories
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.dtype = dtype
    self.router = Router(d, c.num_memories, c.top_k, c.top_k, rngs=rngs)
    self.q_proj = Einsum("btd,dhk->bthk", (d, h, dk), ("embed", "heads", "head_dim"), **kw)
    self.k_proj = Grouped(m, d, (h, dk), ("embed", "heads", "head_dim"), **kw)
    self.v_proj = Grouped(m, d, (h, dv), ("embed", "heads", "head_dim"), **kw)
    if c.transition == "gla":
      self.gate_down = Grouped(m, d, (c.gate_rank,), ("embed", "lora"), **kw)
      self.gate_up = Grouped(m, c.gate_rank, (h, dk), ("lora", "heads", "head_dim"), **kw)
      self.gate_bias = params.zeros((m, h, dk), ("partitions", "heads", "head_dim"),
                                    param_dtype)
    else:
      self.decay_proj = Grouped(m, d, (h,), ("embed", "heads"), **kw)
      self.beta_proj = Grouped(m, d, (h,), ("embed", "heads"), **kw)
      self.a_log = params.param(rngs, uniform_log(1.0, 16.0), (h,), ("heads",),
                                jnp.float32)
      self.dt_bias = params.param(rngs, dt_bias_init, (h,), ("heads",), jnp.float32)
    w = c.short_conv
    conv = lambda dim: ShortConv(w, (h, dim), ("heads", "head_dim"), **kw) if w else None
    self.q_conv, self.k_conv, self.v_conv = conv(dk), conv(dk), conv(dv)
    self.out = OutputHead(c, **kw)

  def init_cache(self, batch: int, max_len: int | None = None) -> RecurrentCache:
    """A zero cache; `max_len` is ignored (the states do not grow with T)."""
    del max_len
    c = self.config
    m = c.memories
    state = jnp.zeros((batch, m, c.num_heads, c.head_k, c.head_v), jnp.float32)
    conv = None
    if c.short_conv:
      conv = tuple(jnp.zeros((batch, m, c.short_conv - 1, c.num_heads, dim), self.dtype)
                   for dim in (c.head_k, c.head_k, c.head_v))
    return RecurrentCache(state, conv)

  def _route(self, x: jax.Array) -> Routing:
    r = self.router(x)
    w = r.write_weights / jnp.sum(r.write_weights, axis=-1, keepdims=True)
    return r._replace(write_weights=w)

  def _gates(self, xs: jax.Array, slots: Slots):
    """(g, beta) of the sorted slots: g float32 [P, H, Dk] (gla) or [P, H] (delta);
    beta float32 [P, H] or None."""
    c = self.config
    sizes = slots.group_sizes
    if c.transition == "gla":
      logits = self.gate_up(self.gate_down(xs, sizes), sizes).astype(jnp.float32)
      bias = jnp.take(self.gate_bias[...].astype(jnp.float32), slots.memory, axis=0)
      return jax.nn.log_sigmoid(logits + bias) / c.gate_normalizer, None
    a = self.decay_proj(xs, sizes).astype(jnp.float32)
    g = -jnp.exp(self.a_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
    beta = jax.nn.sigmoid(self.beta_proj(xs, sizes).astype(jnp.float32))
    return g, beta

  def _convs(self, qkv, slots: Slots, states, num_segments: int):
    """The q / k / v short convs over each segment's stream, from `states` (the tables
    [Z, w - 1, H, D*], or None: zeros); returns (q, k, v) and the new tables (None
    without short conv)."""
    c = self.config
    if not c.short_conv:
      return qkv, None
    states = states or (None,) * 3
    outs = []
    for layer, val, old in zip((self.q_conv, self.k_conv, self.v_conv), qkv, states):
      if old is None:
        old = jnp.zeros((num_segments, c.short_conv - 1) + val.shape[1:], self.dtype)
      outs.append(segment_conv(layer.kernel[...].astype(self.dtype), val, slots, old))
    return tuple(y for y, _ in outs), tuple(s for _, s in outs)

  def attend(self, x: jax.Array, cache: RecurrentCache | None = None, cu_seqlens=None):
    """x [B, T, D] -> (o [B, T, H, Dv] before the output head, the updated cache or
    None, the router's `Routing` with renormalised weights)."""
    c = self.config
    b, t, _ = x.shape
    m = c.memories
    routing = self._route(x)
    if cu_seqlens is None:
      seq, nseq = jnp.repeat(jnp.arange(b, dtype=jnp.int32), t), b
    else:
      cu = jnp.asarray(cu_seqlens, jnp.int32)
      seq, nseq = reference.sequence_ids(cu, t)[0].astype(jnp.int32), cu.shape[0] - 1
    slots = make_slots(routing.write_indices, seq, nseq, c.num_memories, c.shared_memory)
    routed = slots.rows.shape[0]

    def to_slots(z):  # [B, T, ...] -> the sorted slots [P, ...]
      z = z.reshape((b * t,) + z.shape[2:])
      rep = jnp.repeat(z, c.top_k, axis=0)
      out = packing.scatter_rows(rep, slots.rows, routed)
      return jnp.concatenate([out, z]) if c.shared_memory else out

    # [B, ...] <-> [M B, ...] (segment z = memory * B + row): the cache is batch-major
    to_table = lambda s: jnp.swapaxes(s, 0, 1).reshape((m * b,) + s.shape[2:])
    from_table = lambda s: jnp.swapaxes(s.reshape((m, b) + s.shape[1:]), 0, 1)

    xs = to_slots(x.astype(self.dtype))
    q = to_slots(self.q_proj(x))
    k = self.k_proj(xs, slots.group_sizes)
    v = self.v_proj(xs, slots.group_sizes)
    g, beta = self._gates(xs, slots)
    (q, k, v), conv = self._convs((q, k, v), slots, None if cache is None else
                                  tuple(map(to_table, cache.conv or ())), m * nseq)
    if conv and cache is not None:  # with a cache S == B (no packing)
      conv = tuple(map(from_table, conv))
    q = features.activate(c.query_activation, q)
    k = features.activate(c.key_activation, k)
    v = features.activate(c.value_activation, v)
    if c.transition == "delta":
      q, k = l2_normalize(q), l2_normalize(k)
    state = None if cache is None else to_table(cache.state)
    if cache is not None and t == 1:
      o, state = self._decode(q, k, v, g, beta, state, slots)
    else:
      o, state = self._sequence(q, k, v, g, beta, state, slots)
    # back to tokens: the routed outputs weighted by w and summed, plus the shared one
    o_routed = packing.gather_rows(o[:routed], slots.rows)
    o_routed = o_routed.reshape((b * t, c.top_k) + o.shape[1:])
    w = routing.write_weights.reshape(b * t, c.top_k, 1, 1)
    out = jnp.sum(o_routed.astype(jnp.float32) * w, axis=1)
    if c.shared_memory:
      out = out + o[routed:].astype(jnp.float32)
    out = out.astype(self.dtype).reshape((b, t) + o.shape[1:])
    new_cache = None if cache is None else RecurrentCache(from_table(state), conv)
    return out, new_cache, routing

  def _sequence(self, q, k, v, g, beta, state, slots: Slots):
    """One packed call over every (memory, sequence) segment; state: [Z, H, Dk, Dv]
    initial states or None (zeros, no final states returned)."""
    c = self.config
    kw = dict(initial_state=state, output_final_state=state is not None,
              cu_seqlens=slots.cu_seqlens, impl=c.impl, chunk_size=c.chunk_size)
    if c.transition == "gla":
      o, final = ops.gla(q[None], k[None], v[None], g[None], **kw)
    else:
      o, final = gdn(q[None], k[None], v[None], g[None], beta[None], **kw)
    return o[0], final

  def _decode(self, q, k, v, g, beta, state, slots: Slots):
    """One step on the selected memories' states: every slot is its own segment."""
    c = self.config
    mine = jnp.take(state, slots.segment, axis=0)
    if c.transition == "gla":
      o, new = ops.gla_decode_step(q, k, v, g, mine)
    else:
      o, new = gdn_decode_step(q, k, v, g, beta, mine)
    return o, state.at[slots.segment].set(new)
