"""Test-session settings, applied before JAX starts.

XLA's CPU backend optimisation is turned off: the suite is dominated by compiling many
small programs, and -O0 code computes the same values (no fast-math either way) while
compiling several times faster. Set XLA_FLAGS yourself to override.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
