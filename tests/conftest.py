"""Test-session settings, applied before JAX starts (subprocesses the tests start
inherit them through the environment).

The suite is dominated by XLA compiling many small CPU programs, so compilation is made
cheap: backend optimisation off (-O0 code computes the same values, no fast-math
either way) and, where the installed XLA has the flag, its classic loop emitters
instead of the fusion emitters (on 2 cores the README's test command went from 1307 s
to 839 s with that second flag). Set XLA_FLAGS yourself to override.

Every compiled program also goes to a persistent compilation cache in the temp dir
(SSE_JAX_TEST_CACHE names another place; JAX_COMPILATION_CACHE_DIR set by you wins):
the trainer's subprocesses and the notebook kernels compile the same small programs
again and again, and a later session on the same machine starts warm. No size limit:
a limit makes JAX lock the directory with the optional `filelock` package and, where
that is missing, turns the cache off.
"""

import os
import subprocess
import sys
import tempfile


def _xla_accepts(flag: str) -> bool:
  """Whether this jaxlib's XLA starts with `flag` in XLA_FLAGS: XLA aborts the process
  on a flag it does not define (silently, before pytest prints anything), and these are
  internal flags a release may drop. A string search of the shared libraries is not
  enough: jaxlib 0.11 still contains this flag's name but refuses it. So one child
  process starts the CPU backend with it (about a second, once per test session)."""
  probe = "import jax; jax.devices('cpu')"
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  try:
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          timeout=120).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


# Only when unset: the xdist workers inherit the controller's setting, and a user's wins.
if "XLA_FLAGS" not in os.environ:
  _FLAGS = ["--xla_backend_optimization_level=0"]
  if _xla_accepts("--xla_cpu_use_fusion_emitters=false"):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
  os.environ["XLA_FLAGS"] = " ".join(_FLAGS)

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ.get(
      "SSE_JAX_TEST_CACHE", os.path.join(tempfile.gettempdir(), "sse_jax_test_jax_cache"))
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
