"""Run by test_sharding.py in a fresh process with 8 simulated CPU devices.

Checks, under a 4 x 2 ("data", "model") mesh, that gla / sse (XLA and Pallas impls)
give the unsharded reference's numbers, forward and gradients, and that the compiled
programs contain no all-gather (routing and packing stay on each device's shard).
Prints one line per check; exits non-zero on the first failure.
"""

import functools
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")

import jax  # pylint: disable=g-import-not-at-top
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from sse_jax import ops  # pylint: disable=g-import-not-at-top
from tests.op_testing import random_qkvg, random_routing, rel_err  # pylint: disable=g-import-not-at-top


def main():
  assert jax.device_count() == 8, jax.device_count()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  b, t, h, d, n = 8, 64, 4, 16, 4
  x = random_qkvg(jax.random.PRNGKey(0), b, t, h, d, d)
  w, idx = random_routing(jax.random.PRNGKey(1), b, t, n, 2)

  def loss(q, k, v, g, w, impl):
    o, (f, f0) = ops.sse(q, k, v, g, w, idx, num_partitions=n, impl=impl,
                         shared=(q, k, g), output_final_state=True, chunk_size=32)
    o2, _ = ops.gla(q, k, v, g, impl="pallas_chunk" if "pallas" in impl else "chunk",
                    chunk_size=32)
    return (o * o).sum() + (f * f).sum() + (f0 * f0).sum() + (o2 * o).sum()

  act = NamedSharding(mesh, P("data", None, "model", None))
  args = [jax.device_put(a, act) for a in x]
  args.append(jax.device_put(w, NamedSharding(mesh, P("data"))))
  failures = 0
  for impl in ("varlen", "masking", "pallas_varlen"):
    ref_val, ref_grads = jax.value_and_grad(loss, (0, 1, 2, 3, 4))(*x, w, impl="scan")
    fn = jax.jit(jax.value_and_grad(functools.partial(loss, impl=impl), (0, 1, 2, 3, 4)))
    with jax.set_mesh(mesh):
      val, grads = fn(*args)
      hlo = fn.lower(*args).compile().as_text()
    errs = [rel_err(val, ref_val)] + [rel_err(a, r) for a, r in zip(grads, ref_grads)]
    gathers = hlo.count("all-gather")
    ok = max(errs) < 1e-4 and gathers == 0
    failures += not ok
    print(f"{impl}: max rel err {max(errs):.2e}, all-gathers {gathers}: "
          f"{'ok' if ok else 'FAIL'}", flush=True)
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  main()
