"""Test-session settings, applied before JAX starts (subprocesses the tests start
inherit them through the environment).

The suite is dominated by XLA compiling many small CPU programs, so compilation is made
cheap: backend optimisation off (-O0 code computes the same values, no fast-math
either way) and the classic loop emitters instead of the fusion emitters (on 2 cores
the suite went from 1307 s to 839 s with the second flag; compiles of one float64 SSE
gradient test dropped 2-3x). Set XLA_FLAGS yourself to override.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
