"""experiments.kernel_work: the bytes a Pallas kernel's call moves (read from its
signature in the program lowered for CUDA: no GPU needed), the FLOPs of its matrix
products (from the traced kernel body), and rates from them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from experiments import kernel_work
from experiments import profile_kernels
from pallas_kernels import chunk_gla
from sse_jax import ops
from tests.test_ops_gdn import random_gdn

GDN_KERNELS = {"gdn_prepare", "gdn_states", "gdn_outputs", "gdn_local_du", "gdn_dstates",
               "gdn_grads_square", "gdn_grads_tiles"}  # split_grads, the default


def test_tensor_and_signature_bytes():
  assert kernel_work.tensor_bytes("4x64x", "bf16") == 4 * 64 * 2
  assert kernel_work.tensor_bytes("", "i32") == 4
  with pytest.raises(ValueError, match="'f8E4M3'"):
    kernel_work.tensor_bytes("2x", "f8E4M3")
  line = ('%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%a) {ir = "tensor<9x9xf64>"} : '
          '(tensor<2x3xf32>, tensor<i32>) -> tensor<5xbf16>')
  assert kernel_work.signature_bytes(line) == 2 * 3 * 4 + 4 + 5 * 2  # not the IR's tensor


def _dense_gdn_grads(t=128, h=2, d=64):
  x = random_gdn(jax.random.PRNGKey(0), 1, t, h, d, d, jnp.bfloat16)
  plan = ops.Plan(ops.Algorithm.CHUNK, ops.PallasCore(None, False))
  loss = lambda *a: jnp.sum(ops.gdn(*a, impl=plan)[0].astype(jnp.float32))
  # value_and_grad: the loss keeps o, and so the output kernel, in the program.
  return jax.value_and_grad(loss, argnums=(0, 1, 2)), x


def test_gdn_kernels_bytes_and_flops_by_hand():
  """Dense fwd + bwd, C = 64: prepare moves k, v (bf16) and g, beta (fp32) in, G, T
  (fp32) and W, U (bf16) out; the output kernel multiplies Q S, Q K^T and P u per
  (chunk, head), 2 C D D + 2 C C D + 2 C C D; the walks' products sit in loops of
  data-dependent length (None)."""
  t, h, d, c = 128, 2, 64, 64
  fn, x = _dense_gdn_grads(t, h, d)
  io = kernel_work.io_bytes(fn, *x)
  flops = kernel_work.matmul_flops(fn, *x)
  assert set(io) == set(flops) == GDN_KERNELS
  nc = t // c
  keys, gates, square = nc * c * h * d, nc * c * h, nc * h * c * c
  assert io["gdn_prepare"] == 4 * keys * 2 + 3 * gates * 4 + square * 4
  assert flops["gdn_outputs"] == nc * h * (2 * c * d * d + 2 * 2 * c * c * d)
  assert flops["gdn_local_du"] == nc * h * 2 * 2 * c * c * d
  assert flops["gdn_states"] is None and flops["gdn_dstates"] is None
  assert flops["gdn_grads_square"] + flops["gdn_grads_tiles"] > flops["gdn_outputs"]


def test_rate_matches_names_and_skips_unknown_work():
  work = {"gdn_prepare": 1e9, "gdn_grads": 4e9, "gdn_states": None, "sweep": 0.0}
  ms = {"gdn_prepare": 0.5, "gdn_grads.1": 2.0, "gdn_states": 1.0, "other": 1.0,
        "sweep": 1.0}  # a walk without matrix products: no rate, not 0 TFLOP/s
  assert kernel_work.rate(work, ms) == {"gdn_prepare": 1e9 / 0.5e-3 / 1e9,
                                        "gdn_grads.1": 4e9 / 2e-3 / 1e9}
  assert kernel_work.rate(work, ms, 1e12)["gdn_grads.1"] == pytest.approx(2.0)  # TFLOP/s


def test_matmul_flops_needs_a_pallas_call():
  with pytest.raises(ValueError, match="no pallas_call"):
    kernel_work.matmul_flops(lambda a: a @ a, jnp.ones((4, 4)))


def test_profile_kernels_work_of_every_gla_kernel():
  x = profile_kernels.make_inputs(256, 2, 32, 64)
  bs = chunk_gla.BlockSizes(chunk=64)
  io, flops = profile_kernels.per_kernel_work(x, bs)
  assert set(io) == set(flops) == set(profile_kernels.kernel_calls(x, bs, True))
  # scores read q, k and the gates: at least 2 [NC, C, H, D] bf16 arrays.
  assert all(v > 0 for v in io.values()) and io["scores"] >= 2 * 256 * 2 * 32 * 2
  assert flops["outputs"] > 0
  rates = profile_kernels.work_rates(io, flops, {"outputs": 1.0})
  line = profile_kernels.with_rates("outputs", 1.0, rates)
  assert line == (f"outputs 1.000 ms ({io['outputs'] / 1e6:.0f} GB/s, "
                  f"{flops['outputs'] / 1e9:.1f} TFLOP/s)")
