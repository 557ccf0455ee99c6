"""The initialiser's threefry lowering switch (`state.rng_kernel_lowering`)."""

import jax
import numpy as np
import pytest

from sse_jax.train import state as state_lib

FLAG = "jax_threefry_gpu_kernel_lowering"


@pytest.mark.skipif(not hasattr(jax.config, FLAG), reason="this JAX has no such option")
@pytest.mark.parametrize("before", [False, True])
def test_sets_the_flag_and_restores_it(before):
  jax.config.update(FLAG, before)
  try:
    with state_lib.rng_kernel_lowering():
      assert getattr(jax.config, FLAG) is True
    assert getattr(jax.config, FLAG) is before
    with pytest.raises(RuntimeError):
      with state_lib.rng_kernel_lowering(False):
        assert getattr(jax.config, FLAG) is False
        raise RuntimeError("inside")
    assert getattr(jax.config, FLAG) is before
  finally:
    jax.config.update(FLAG, False)


def test_draws_do_not_change():
  """The same key gives the same bits with the switch on and off (on CPU both lowerings
  are XLA's; `experiments.init_compile` checks the GPU kernel against XLA's lowering)."""
  draw = lambda: np.asarray(jax.jit(lambda k: jax.random.normal(k, (64, 33)))(
      jax.random.key(3)))
  with state_lib.rng_kernel_lowering(True):
    on = draw()
  with state_lib.rng_kernel_lowering(False):
    off = draw()
  np.testing.assert_array_equal(on, off)
  assert np.std(on) > 0.5
