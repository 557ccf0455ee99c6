"""Copied buffers against slots read in place (`BlockSizes.gather_rows`), split by what
may make in place slower: SSE varlen with and without the shared partition (its slots as
two parts, or one) at L = 32K, and packed GLA (one part) at 2K, 8K and 32K. Fwd + bwd,
median of 10 runs after 3 warm-up runs, in the Fig. 6 setting (8 heads of 128, bf16,
K = 1, cu_seqlens = [0, L/2, L]); needs a GPU.

    python -m experiments.in_place_probe results/bench_ops/in_place_h100/parts_and_lengths.json
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from experiments import op_setting
from pallas_kernels import chunk_gla
from sse_jax import ops
from sse_jax.ops import impl as impl_lib


def plan(name: str, in_place: bool) -> ops.Plan:
  core = ops.PallasCore(chunk_gla.BlockSizes(gather_rows=in_place), interpret=False)
  return dataclasses.replace(impl_lib.named(name), core=core)


def sse_step(x, in_place: bool, shared: bool):
  def loss(q, k, v, g, w):
    o, _ = ops.sse(q, k, v, g, w, x["idx"], num_partitions=4, cu_seqlens=x["cu"],
                   impl=plan("pallas_varlen", in_place),
                   shared=(x["q0"], x["k0"], g) if shared else None)
    return jnp.sum(o.astype(jnp.float32) * x["cot"].astype(jnp.float32))
  return jax.jit(lambda x: jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(
      x["q"], x["k"], x["v"], x["g"], x["w"]))


def gla_step(x, in_place: bool):
  def loss(q, k, v, g):
    o, _ = ops.gla(q, k, v, g, cu_seqlens=x["cu"], impl=plan("pallas_chunk", in_place))
    return jnp.sum(o.astype(jnp.float32) * x["cot"].astype(jnp.float32))
  return jax.jit(lambda x: jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(
      x["q"], x["k"], x["v"], x["g"]))


def main(out: str) -> None:
  rows = []

  def time(label, fn, x):
    ms, _ = op_setting.time_fn(fn, x, 10, 3)
    rows.append((label, ms))
    print(f"{label:50s} {ms:8.3f} ms", flush=True)

  x = op_setting.make_inputs(32768, 4, 8, 128, 1)
  for shared in (True, False):
    for in_place in (False, True):
      time(f"sse varlen L=32768 shared={shared} in_place={in_place}",
           sse_step(x, in_place, shared), x)
  for length in (2048, 8192, 32768):
    x = op_setting.make_inputs(length, 4, 8, 128, 1)
    for in_place in (False, True):
      time(f"gla L={length} in_place={in_place}", gla_step(x, in_place), x)
  with open(out, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
              indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
