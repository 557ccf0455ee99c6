"""Test-session settings, applied before JAX starts (subprocesses the tests start
inherit them through the environment).

The suite is dominated by XLA compiling many small CPU programs, so compilation is made
cheap: backend optimisation off (-O0 code computes the same values, no fast-math
either way) and, where the installed XLA has the flag, its classic loop emitters
instead of the fusion emitters (on 2 cores the README's test command went from 1307 s
to 839 s with that second flag). Set XLA_FLAGS yourself to override.
"""

import glob
import importlib.util
import mmap
import os


def _xla_knows(flag: str) -> bool:
  """Whether the installed jaxlib's XLA defines `flag`: XLA aborts on unknown flags,
  and these are internal ones that a later release may drop."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or spec.origin is None:
    return False
  for lib in glob.glob(os.path.join(os.path.dirname(spec.origin), "*.so")):
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      if m.find(flag.encode()) >= 0:
        return True
  return False


# Only when unset: the xdist workers inherit the controller's setting, and a user's wins.
if "XLA_FLAGS" not in os.environ:
  _FLAGS = ["--xla_backend_optimization_level=0"]
  if _xla_knows("xla_cpu_use_fusion_emitters"):
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
  os.environ["XLA_FLAGS"] = " ".join(_FLAGS)
