"""The GDN (Gated DeltaNet) mixer against its equations written directly in float64 on
top of the op's scan reference (outputs and parameter gradients), packed sequences
against each sequence alone, chunked prefill + decode steps against one full call, and
the config's one-line errors. The float64 helpers here also serve the SSE-GDN tests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sse_jax import ops
from sse_jax.layers import GDN, GDNConfig
from sse_jax.layers.delta import DeltaGates
from sse_jax.layers.testing import random_module, router_margin
from tests.op_testing import assert_close, x64

B, T, D, H = 2, 21, 32, 2   # T = 21: not a multiple of the chunk (16)
BASE = GDNConfig(hidden=D, num_heads=H, chunk_size=16)
CASES = {
    "conv_chunk": BASE,
    "silu_no_conv_scan_neg_eigval": dataclasses.replace(
        BASE, short_conv=0, query_activation="silu", key_activation="silu",
        value_activation="silu", impl="scan", allow_neg_eigval=True, key_dim=8,
        value_dim=12, output_gate=False),
}
TOL = 1e-5 if jax.default_backend() == "cpu" else 1e-4


@pytest.fixture(autouse=True)
def _full_float32_matmuls():  # TF32 on a GPU would be ~1e-4 off the float64 reference
  with jax.default_matmul_precision("highest"):
    yield


def gentle_decays(module, seed: int = 0) -> None:
  """Every DeltaGates' A_log := log U(0.02, 0.3): random parameters (A_log ~ 1) would
  decay the state by ~exp(-3) per step, so nothing would carry across tokens and the
  cache and packing tests could not fail."""
  rng = np.random.default_rng(seed)
  for _, node in nnx.iter_graph(module):
    if isinstance(node, DeltaGates):
      a = rng.uniform(0.02, 0.3, node.a_log.shape)
      node.a_log.set_value(jnp.asarray(np.log(a), jnp.float32))


def make(cfg, seed=3):
  layer = random_module(lambda: GDN(cfg, rngs=nnx.Rngs(0)), seed)
  gentle_decays(layer, seed)
  return layer


@nnx.jit
def call(layer, x, cache=None, cu_seqlens=None):
  return layer(x, cache, cu_seqlens=cu_seqlens)


@nnx.jit
def output_and_grads(layer, x, cot):
  """(y, d sum(y * cot) / d params) of the layer (float32)."""
  def loss(m):
    y = m(x).y
    return jnp.sum(y * cot), y
  (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
  return y, nnx.to_pure_dict(nnx.state(grads, nnx.Param))


# --- the float64 reference: the layer's equations, one op call (scan) -----------------

ACT = {"identity": lambda z: z, "silu": jax.nn.silu,
       "softmax": lambda z: jax.nn.softmax(z, axis=-1)}


def float64_params(layer):
  return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64),
                      nnx.to_pure_dict(nnx.state(layer, nnx.Param)))


def conv_silu(y, kernel):
  """silu(sum_j kernel[j] * y[t - w + 1 + j]) with zeros before the first token."""
  w, t = kernel.shape[0], y.shape[1]
  padded = jnp.pad(y, [(0, 0), (w - 1, 0)] + [(0, 0)] * (y.ndim - 2))
  return jax.nn.silu(sum(kernel[j] * padded[:, j:j + t] for j in range(w)))


def project(p, x, name: str, conv: bool):
  """x W_name [B, T, H, D], through its short conv + SiLU when the layer has one."""
  y = jnp.einsum("btd,dhk->bthk", x, p["qkv"][f"{name}_proj"]["kernel"])
  return conv_silu(y, p["qkv"][f"{name}_conv"]["kernel"]) if conv else y


def l2(z):
  return z / jnp.sqrt(jnp.sum(z * z, axis=-1, keepdims=True) + 1e-6)


def delta_gates(p, x, neg_eigval: bool):
  """g = -exp(A_log) softplus(x W_a + dt_bias), beta = sigmoid(x W_b) (x 2): [B, T, H]."""
  g = -jnp.exp(p["a_log"]) * jax.nn.softplus(x @ p["a_proj"]["kernel"] + p["dt_bias"])
  beta = jax.nn.sigmoid(x @ p["b_proj"]["kernel"])
  return g, (2.0 * beta if neg_eigval else beta)


def output_head(p, o, x, c):
  """(RMSNorm_head(o) [* silu(x W_gate)]) W_o."""
  o = o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + c.norm_eps) * p["norm"]["scale"]
  if c.output_gate:
    o = o * jax.nn.silu(jnp.einsum("btd,dhk->bthk", x, p["gate"]["kernel"]))
  return jnp.einsum("bthk,hkd->btd", o, p["proj"]["kernel"])


def gdn_reference(p, x, c):
  """The GDN layer (sse_jax.layers.gdn's docstring) in float64 on ops.gdn's scan."""
  conv = c.short_conv > 0
  q = l2(ACT[c.query_activation](project(p, x, "q", conv)))
  k = l2(ACT[c.key_activation](project(p, x, "k", conv)))
  v = ACT[c.value_activation](project(p, x, "v", conv))
  g, beta = delta_gates(p["gates"], x, c.allow_neg_eigval)
  o, _ = ops.gdn(q, k, v, g, beta, impl="scan")
  return output_head(p["out"], o, x, c)


def reference_and_grads(fn, p, x, cot):
  """fn(p, x) and d sum(fn(p, x) * cot) / dp, in float64."""
  with x64():
    x, cot = (jnp.asarray(np.asarray(z), jnp.float64) for z in (x, cot))
    y, vjp = jax.vjp(lambda p: fn(p, x), p)
    return np.asarray(y), jax.tree.map(np.asarray, vjp(cot)[0])


def compare_grads(got, want, tol):
  for (path, g), (_, w) in zip(jax.tree_util.tree_leaves_with_path(got),
                               jax.tree_util.tree_leaves_with_path(want)):
    assert_close(g, w, tol, jax.tree_util.keystr(path))


def check_margin(layer, x):
  """A routed layer's comparison is well posed only if float32 rounding cannot flip a
  top-k choice of its router."""
  if hasattr(layer, "router"):
    c, probs = layer.config, layer.router(x).probs
    assert min(router_margin(probs, c.writers), router_margin(probs, c.readers)) > 1e-4


def check_against_reference(layer, reference, seed: int, what: str):
  """The layer's outputs and parameter gradients (of sum(y * cot)) on random x [B, T, D]
  against reference(params, x) in float64; returns the layer's gradients."""
  x = jax.random.normal(jax.random.key(seed), (B, T, D))
  cot = jax.random.normal(jax.random.key(seed + 1), (B, T, D))
  check_margin(layer, x)
  y, grads = output_and_grads(layer, x, cot)
  with x64():
    p = float64_params(layer)
  ref_y, ref_grads = reference_and_grads(reference, p, x, cot)
  assert_close(y, ref_y, TOL, f"{what} y")
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  compare_grads(grads, ref_grads, 10 * TOL)
  return grads


# --- tests -------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(CASES))
def test_gdn_matches_the_float64_reference_with_gradients(case):
  cfg = CASES[case]
  grads = check_against_reference(make(cfg), lambda p, x: gdn_reference(p, x, cfg), 0,
                                  case)
  assert np.abs(grads["gates"]["a_log"]).max() > 0 and np.abs(grads["gates"]["b_proj"]
                                                              ["kernel"]).max() > 0


CU = np.array([0, 1, 1, 9, 21], np.int32)  # lengths 1, 0, 8, 12


def test_packed_sequences_equal_separate_sequences():
  """Packed, each sequence gives the float64 reference's outputs over that sequence
  alone (no state and no short-conv history crosses a boundary), and the parameter
  gradients are the sums of the sequences' own."""
  cfg = CASES["conv_chunk"]
  layer = make(cfg, seed=5)
  x = jax.random.normal(jax.random.key(3), (1, T, D))
  cot = jax.random.normal(jax.random.key(4), (1, T, D))

  @nnx.jit
  def packed(layer):
    def loss(m):
      y = m(x, cu_seqlens=jnp.asarray(CU)).y
      return jnp.sum(y * cot), y
    (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(layer)
    return y, nnx.to_pure_dict(nnx.state(grads, nnx.Param))

  y, grads = packed(layer)
  with x64():
    p = float64_params(layer)
  spans = [(a, b) for a, b in zip(CU[:-1], CU[1:]) if b > a]
  parts = [reference_and_grads(lambda p, x: gdn_reference(p, x, cfg), p, x[:, a:b],
                               cot[:, a:b]) for a, b in spans]
  assert_close(y, np.concatenate([r for r, _ in parts], axis=1), TOL, "packed y")
  compare_grads(grads, jax.tree.map(lambda *g: sum(g), *[g for _, g in parts]), 10 * TOL)


def cached_pieces(layer, x, ends=(5, 12)):
  """The layer over x [B, T, D] from a fresh cache: prefills up to each of `ends`, then
  one-token decode steps to T. Returns (y [B, T, D] concatenated, the last cache)."""
  cache, pieces = layer.init_cache(x.shape[0]), []
  bounds = (0,) + tuple(ends) + tuple(range(ends[-1] + 1, x.shape[1] + 1))
  for start, end in zip(bounds[:-1], bounds[1:]):
    out = call(layer, x[:, start:end], cache)
    pieces.append(out.y)
    cache = out.cache
  return jnp.concatenate(pieces, axis=1), cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_equal_the_full_call(case):
  layer = make(CASES[case])
  x = jax.random.normal(jax.random.key(4), (B, T, D))
  full = call(layer, x).y
  y, cache = cached_pieces(layer, x)
  assert_close(y, full, TOL, case)
  c = layer.config
  assert cache.state.shape == (B, H, c.head_k, c.head_v)
  assert cache.state.dtype == jnp.float32
  # the state carries information: a decode step from a zero state differs
  fresh = call(layer, x[:, -1:], layer.init_cache(B)).y
  assert float(jnp.abs(fresh - full[:, -1:]).max()) > 1e-3


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match=r"GDNConfig.impl='varlen' is not one of"):
    dataclasses.replace(BASE, impl="varlen")
  with pytest.raises(ValueError, match=r"GDNConfig.gate_rank=8 does not apply to the GDN"):
    dataclasses.replace(BASE, gate_rank=8)
  with pytest.raises(ValueError, match=r"GDNConfig.allow_neg_eigval=1 must be a bool"):
    dataclasses.replace(BASE, allow_neg_eigval=1)


def test_pallas_impls_are_checked_against_the_gdn_kernels_limits():
  """A delta-rule mixer's Pallas impl is checked against the GDN kernels' limits (chunk
  sizes 16-64), not the GLA kernels' (which take 128), when the config is built."""
  from sse_jax.layers.mom import MoMConfig  # pylint: disable=g-import-not-at-top
  from sse_jax.layers.sse import SSEConfig  # pylint: disable=g-import-not-at-top
  for make, impl in ((GDNConfig, "pallas_chunk"),
                     (lambda **kw: SSEConfig(transition="delta", **kw), "pallas_varlen"),
                     (lambda **kw: MoMConfig(transition="delta", **kw), "pallas_chunk")):
    with pytest.raises(ValueError, match=r"impl='pallas_\w+' cannot take chunk_size=128: "
                                         r"the Pallas GDN kernels"):
      make(hidden=64, num_heads=2, impl=impl, chunk_size=128)
    assert make(hidden=64, num_heads=2, impl=impl, chunk_size=64).chunk_size == 64
  assert SSEConfig(hidden=64, num_heads=2, impl="pallas_varlen", chunk_size=128)
