"""experiments.kernel_io: the bytes a Pallas kernel's call moves, read from its signature
in the program lowered for CUDA (no GPU needed), and the bandwidth from them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from experiments import kernel_io
from experiments import profile_kernels
from pallas_kernels import chunk_gla
from sse_jax import ops
from tests.test_ops_gdn import random_gdn


def test_tensor_and_signature_bytes():
  assert kernel_io.tensor_bytes("4x64x", "bf16") == 4 * 64 * 2
  assert kernel_io.tensor_bytes("", "i32") == 4
  with pytest.raises(ValueError, match="'f8E4M3'"):
    kernel_io.tensor_bytes("2x", "f8E4M3")
  line = ('%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%a) {ir = "tensor<9x9xf64>"} : '
          '(tensor<2x3xf32>, tensor<i32>) -> tensor<5xbf16>')
  assert kernel_io.signature_bytes(line) == 2 * 3 * 4 + 4 + 5 * 2  # not the IR's tensor


def test_gdn_prepare_moves_its_operands_and_results_once():
  """The GDN kernels of a dense fwd + bwd, each named; prepare's bytes by hand: k, v in
  bf16 and g, beta in fp32 in; G, T (fp32), W, U (bf16) out."""
  b, t, h, d, c = 1, 128, 2, 64, 64
  x = random_gdn(jax.random.PRNGKey(0), b, t, h, d, d, jnp.bfloat16)
  plan = ops.Plan(ops.Algorithm.CHUNK, ops.PallasCore(None, False))
  loss = lambda *a: jnp.sum(ops.gdn(*a, impl=plan)[0].astype(jnp.float32))
  io = kernel_io.io_bytes(jax.grad(loss, argnums=(0, 1, 2)), *x)
  assert set(io) == {"gdn_prepare", "gdn_states", "gdn_outputs", "gdn_local_du",
                     "gdn_dstates", "gdn_grads"}
  nc = t // c
  keys, gates, square = nc * c * h * d, nc * c * h, nc * h * c * c
  assert io["gdn_prepare"] == 4 * keys * 2 + 3 * gates * 4 + square * 4
  rates = kernel_io.bandwidth(io, {"gdn_prepare": 0.5, "gdn_grads.1": 2.0, "other": 1.0})
  assert rates == {"gdn_prepare": io["gdn_prepare"] / 0.5e-3 / 1e9,
                   "gdn_grads.1": io["gdn_grads"] / 2e-3 / 1e9}


def test_profile_kernels_io_of_every_gla_kernel():
  x = profile_kernels.make_inputs(256, 2, 32, 64)
  io = profile_kernels.per_kernel_io(x, chunk_gla.BlockSizes(chunk=64))
  assert set(io) == set(profile_kernels.kernel_calls(x, chunk_gla.BlockSizes(chunk=64),
                                                     True))
  # scores read q, k and the gates: at least 2 [NC, C, H, D] bf16 arrays.
  assert all(v > 0 for v in io.values()) and io["scores"] >= 2 * 256 * 2 * 32 * 2
