"""Run by test_sharding.py in a fresh process with 8 simulated CPU devices.

Checks, under a 4 x 2 ("data", "model") mesh, that gla / sse (XLA and Pallas impls)
give the unsharded scan reference's numbers, forward and gradients, that the ops' own
shard_map is in the program, and that the compiled programs contain no all-gather
(routing and packing stay on each device's shard); also for packed sequences
(cu_seqlens, B = 1), whose heads are sharded over "model", and for per-partition q, k, v.
Prints one line per check; exits non-zero on the first failure.
"""

import dataclasses
import functools
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from sse_jax import ops  # pylint: disable=g-import-not-at-top
from sse_jax.ops import impl as impl_lib  # pylint: disable=g-import-not-at-top
from tests.op_testing import random_qkvg, random_routing, rel_err  # pylint: disable=g-import-not-at-top


def dense(sse_impl: str) -> ops.Plan:
  """The GLA impl with the chunk core of an SSE impl (the scan for the scan)."""
  plan = impl_lib.named(sse_impl)
  if plan.core is None:
    return plan
  return dataclasses.replace(plan, algorithm=ops.Algorithm.CHUNK)


def main():
  assert jax.device_count() == 8, jax.device_count()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  b, t, h, d, n = 8, 64, 4, 16, 4
  x = random_qkvg(jax.random.PRNGKey(0), b, t, h, d, d)
  w, idx = random_routing(jax.random.PRNGKey(1), b, t, n, 2)

  def loss(q, k, v, g, w, impl):
    o, (f, f0) = ops.sse(q, k, v, g, w, idx, num_partitions=n, impl=impl,
                         shared=(q, k, g), output_final_state=True, chunk_size=32)
    o2, _ = ops.gla(q, k, v, g, impl=dense(impl), chunk_size=32)
    return (o * o).sum() + (f * f).sum() + (f0 * f0).sum() + (o2 * o).sum()

  act = NamedSharding(mesh, P("data", None, "model", None))
  args = [jax.device_put(a, act) for a in x]
  args.append(jax.device_put(w, NamedSharding(mesh, P("data"))))
  failures = 0

  def reference(ref_loss, ref_args):
    """The scan's value and gradients, unsharded (computed once per loss: every impl
    is checked against the same numbers)."""
    return jax.jit(jax.value_and_grad(ref_loss, (0, 1, 2, 3, 4)))(*ref_args)

  def check(name, loss, args, ref):
    """loss under the mesh (sharded inputs) against ref, the scan's (value, grads)."""
    nonlocal failures
    ref_val, ref_grads = ref
    fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4)))
    with jax.set_mesh(mesh):
      lowered = fn.lower(*args)
      compiled = lowered.compile()  # compiled once: run, and its HLO inspected
      val, grads = compiled(*args)
      hlo = compiled.as_text()
    # The ops' shard_map is in the program (manual sharding), not left to GSPMD.
    text = lowered.as_text()
    manual = "manual_computation" in text or "SPMDFullToShardShape" in text
    errs = [rel_err(val, ref_val)] + [rel_err(a, r) for a, r in zip(grads, ref_grads)]
    gathers = hlo.count("all-gather")
    ok = max(errs) < 1e-4 and gathers == 0 and manual
    failures += not ok
    print(f"{name}: max rel err {max(errs):.2e}, all-gathers {gathers}, shard_map "
          f"{manual}: {'ok' if ok else 'FAIL'}", flush=True)

  dense_ref = reference(functools.partial(loss, impl="scan"), (*x, w))
  for impl in ("varlen", "masking", "pallas_varlen", "pallas_masking"):
    check(impl, functools.partial(loss, impl=impl), args, dense_ref)

  # Per-partition q, k, v [B, T, N, H, D]: their heads are axis 3.
  def per_partition_loss(q, k, v, g, w, impl):
    spread = lambda a: jax.numpy.stack([a * (1.0 - 0.2 * i) for i in range(n)], axis=2)
    o, (f, f0) = ops.sse(spread(q), spread(k), spread(v), g, w, idx, num_partitions=n,
                         impl=impl, shared=(q, k, g, v), output_final_state=True,
                         chunk_size=32)
    return (o * o).sum() + (f * f).sum() + (f0 * f0).sum()

  per_partition_ref = reference(functools.partial(per_partition_loss, impl="scan"), (*x, w))
  for impl in ("varlen", "masking"):
    check(f"{impl} per-partition", functools.partial(per_partition_loss, impl=impl), args,
          per_partition_ref)

  # Packed sequences (B = 1, cu_seqlens): the heads are sharded over "model".
  tp = 96
  cu = jax.numpy.asarray([0, 20, 20, 96], jax.numpy.int32)
  xp = random_qkvg(jax.random.PRNGKey(2), 1, tp, h, d, d)
  wp, idxp = random_routing(jax.random.PRNGKey(3), 1, tp, n, 1)

  def packed_loss(q, k, v, g, w, impl):
    gla_impl = dense(impl)
    o, (f, f0) = ops.sse(q, k, v, g, w, idxp, num_partitions=n, impl=impl,
                         shared=(q, k, g), output_final_state=True, chunk_size=32,
                         cu_seqlens=cu)
    o2, f2 = ops.gla(q, k, v, g, impl=gla_impl, chunk_size=32, cu_seqlens=cu,
                     output_final_state=True)
    return ((o * o).sum() + (f * f).sum() + (f0 * f0).sum() + (o2 * o).sum()
            + (f2 * f2).sum())

  heads = NamedSharding(mesh, P(None, None, "model", None))
  pargs = [jax.device_put(a, heads) for a in xp] + [wp]
  packed_ref = reference(functools.partial(packed_loss, impl="scan"), (*xp, wp))
  for impl in ("varlen", "pallas_varlen"):
    check(f"{impl} packed", functools.partial(packed_loss, impl=impl), pargs, packed_ref)
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  main()
