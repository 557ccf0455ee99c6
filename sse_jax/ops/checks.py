"""Input validation shared by every implementation of the GLA / SSE ops.

Every error is a `ValueError` that names the offending argument and its value, so a
mistake in a user's model surfaces at the call, not as a shape error deep inside XLA.
Value checks (index ranges, `cu_seqlens` monotonicity, g <= 0, router weights >= 0)
raise only on concrete arrays; under `jit` the values are unknown and the docstrings
of the ops state the contract. `checked(fn)` is the debugging mode for jitted code:
while it traces fn, the same checks (and finiteness of every floating input) are
added to the traced ops as `checkify` checks, and a failing one raises at the call.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


class Gate(enum.Enum):
  """Where the router probability e_t^i multiplies (docs/design.md, section 2; the
  paper's Table 7)."""

  BOTH = "both"    # write: S += e k^T v ; read: o += e q S
  WRITE = "write"  # only the write
  READ = "read"    # only the read
  NONE = "none"    # selected partitions use weight 1

  @property
  def on_write(self) -> bool:
    return self in (Gate.BOTH, Gate.WRITE)

  @property
  def on_read(self) -> bool:
    return self in (Gate.BOTH, Gate.READ)


def parse_enum(enum_cls: type[enum.Enum], value: Any, name: str) -> Any:
  """Returns `enum_cls(value)`, or raises a ValueError listing the choices."""
  if isinstance(value, enum_cls):
    return value
  try:
    return enum_cls(value)
  except ValueError:
    choices = ", ".join(repr(m.value) for m in enum_cls)
    raise ValueError(f"{name}={value!r} is not one of {choices}") from None


def as_array(name: str, x):
  """x as an array (lists and numpy arrays are converted); None stays None."""
  if x is None or isinstance(x, jax.Array):
    return x
  if isinstance(x, (tuple, dict)):
    raise ValueError(f"{name} must be an array, got a {type(x).__name__}")
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}: {e}") from None


# True while `checked` traces its function: only then do traced inputs get checks.
# Not always: even a checkify.debug_check that plain jit drops gives the jaxpr an
# effect, which moves every call of the jitted function off JAX's fast C++ dispatch
# path (a tiny jitted function on CPU: 4 us -> 46 us per call).
_CHECKING = contextvars.ContextVar("sse_jax_ops_checking", default=False)


@contextlib.contextmanager
def _checking():
  token = _CHECKING.set(True)
  try:
    yield
  finally:
    _CHECKING.reset(token)


def check_scale(scale) -> None:
  """scale multiplies q: None (Dk ** -0.5) or one number."""
  if scale is not None and jnp.ndim(scale) != 0:
    raise ValueError(f"scale must be a scalar, got shape {tuple(jnp.shape(scale))}")


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_floating(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def check_qkvg(q, k, v, g) -> tuple[int, int, int, int, int]:
  """Checks q, k, g: [B, T, H, Dk] and v: [B, T, H, Dv]; returns (B, T, H, Dk, Dv)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
    if x.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 [B, T, H, D], got shape {tuple(x.shape)}")
    check_floating(name, x)
  if q.shape != k.shape:
    raise ValueError(
        f"q and k must have the same shape [B, T, H, Dk], got q {tuple(q.shape)}"
        f" and k {tuple(k.shape)}")
  if g.shape != k.shape:
    raise ValueError(
        f"g must have the shape of k {tuple(k.shape)}, got {tuple(g.shape)}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(
        f"v must share [B, T, H] with k {tuple(k.shape[:3])}, got v {tuple(v.shape)}")
  b, t, h, dk = k.shape
  return b, t, h, dk, v.shape[-1]


def check_cu_seqlens(cu_seqlens, batch: int, length: int) -> int | None:
  """Validates packed-sequence boundaries; returns the number of sequences S."""
  if cu_seqlens is None:
    return None
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError(
        f"cu_seqlens must be a 1-D array [S + 1] with S >= 1, got shape"
        f" {tuple(cu_seqlens.shape)}")
  if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens must be integer, got dtype {cu_seqlens.dtype}")
  if batch != 1:
    raise ValueError(
        f"cu_seqlens describes packed sequences and needs batch size B == 1, got"
        f" B={batch}")
  rule = f"cu_seqlens must start at 0, be non-decreasing and end at T={length}; got"
  if is_concrete(cu_seqlens):
    c = np.asarray(cu_seqlens)
    if c[0] != 0 or c[-1] != length or np.any(np.diff(c) < 0):
      raise ValueError(f"{rule} {c.tolist()}")
  elif _CHECKING.get():
    c = cu_seqlens
    checkify.debug_check((c[0] == 0) & (c[-1] == length) & jnp.all(c[1:] >= c[:-1]),
                         rule + " {}", c)
  return cu_seqlens.shape[0] - 1


def check_routing(weights, indices, batch: int, length: int,
                  num_partitions: int) -> int:
  """Checks weights/indices [B, T, K]; returns K (the top-k)."""
  if not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
    raise ValueError(f"num_partitions must be a positive int, got {num_partitions!r}")
  if indices.ndim != 3 or indices.shape[:2] != (batch, length):
    raise ValueError(
        f"indices must have shape [B, T, K] = [{batch}, {length}, K], got"
        f" {tuple(indices.shape)}")
  if weights.shape != indices.shape:
    raise ValueError(
        f"weights must have the shape of indices {tuple(indices.shape)}, got"
        f" {tuple(weights.shape)}")
  if not jnp.issubdtype(indices.dtype, jnp.integer):
    raise ValueError(f"indices must be integer partition ids, got dtype {indices.dtype}")
  check_floating("weights", weights)
  top_k = indices.shape[-1]
  if not 1 <= top_k <= num_partitions:
    raise ValueError(
        f"top-k K={top_k} (last axis of indices) must be in [1, num_partitions="
        f"{num_partitions}]")
  in_range = f"indices must lie in [0, num_partitions={num_partitions}), got values in"
  distinct = ("indices must be distinct within a token (a partition selected twice by"
              " the same token)")
  if is_concrete(indices) and indices.size:
    idx = np.asarray(indices)
    if idx.min() < 0 or idx.max() >= num_partitions:
      raise ValueError(f"{in_range} [{idx.min()}, {idx.max()}]")
    if top_k > 1:
      s = np.sort(idx, axis=-1)
      if np.any(s[..., 1:] == s[..., :-1]):
        raise ValueError(distinct)
  elif indices.size and _CHECKING.get():
    lo, hi = jnp.min(indices), jnp.max(indices)
    checkify.debug_check((lo >= 0) & (hi < num_partitions), in_range + " [{}, {}]", lo,
                         hi)
    if top_k > 1:
      s = jnp.sort(indices, axis=-1)
      checkify.debug_check(jnp.all(s[..., 1:] != s[..., :-1]), distinct)
  return top_k


def require(ok, name: str, x, rule: str, *, eager: bool = True) -> None:
  """Every element of x satisfies `rule`: ok(x) (a bool array of x's shape) is True.

  ok is evaluated only when x is checked. Concrete x (with `eager`): otherwise a
  one-line ValueError with the first offending position and value, e.g. "g must be
  <= 0 (...), got g[0, 5, 0, 3] = 6.0 (and 2 more)". Traced x: the same message as a
  checkify check while `checked` traces (the debug_check is a no-op outside
  checkify), else nothing.
  """
  if x is None or x.size == 0:
    return
  if is_concrete(x):
    if not eager:
      return
    # On the device, one bool to the host (not x); evaluated now even while a jit
    # traces a function that closes over x.
    with jax.ensure_compile_time_eval():
      ok = ok(x)
      if bool(jnp.all(ok)):
        return
    bad = np.argwhere(~np.asarray(ok))
    pos = tuple(int(i) for i in bad[0])
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise ValueError(f"{name} must be {rule}, got {name}[{', '.join(map(str, pos))}] ="
                     f" {np.asarray(x)[pos]}{more}")
  if not _CHECKING.get():
    return
  ok = ok(x)
  first = jnp.argmax(~ok.reshape(-1))  # the first False (0 when there is none)
  pos = jnp.unravel_index(first, ok.shape)
  checkify.debug_check(jnp.all(ok), f"{name} must be {rule}, got {name}{{}} = {{}}",
                       jnp.stack(pos), x[pos])


def check_log_decay(name: str, g) -> None:
  """g <= 0: a log decay, exp(g) in [0, 1]. -inf (a hard reset) is allowed; NaN and
  g > 0 (a state that grows without bound) are not."""
  require(lambda g: g <= 0, name, g, "<= 0 (a log decay; -inf resets the state)")


def check_weights(name: str, w) -> None:
  """Router weights are probabilities: >= 0 (NaN fails too)."""
  require(lambda w: w >= 0, name, w, ">= 0 (router probabilities)")


def check_finite(name: str, x) -> None:
  """x has no NaN or inf. Checked on traced inputs under `checked` only: on concrete
  ones it would scan every activation of every eager call."""
  require(jnp.isfinite, name, x, "finite", eager=False)


def checked(fn: Callable, *, errors=checkify.user_checks, **jit_kwargs) -> Callable:
  """`jax.jit(fn)` that raises when an op's input breaks its contract.

  Under a plain `jit` the ops cannot see values, so bad `cu_seqlens`, out-of-range or
  repeated indices, g > 0, negative router weights and non-finite inputs (q, k, v,
  weights, initial states; g may be -inf) go unnoticed. Here `fn` runs under
  `checkify.checkify`, which turns the ops' recorded checks (`require`) into an error
  value, and the call raises it (a `checkify.JaxRuntimeError`, a ValueError) with
  the first failed check's message, e.g. "g must be <= 0 (...), got g[0 5 0 3] = 6.0".
  The checks cost a reduction over each input and an error value per call: a
  debugging mode, not for training. `errors` adds checkify's automatic checks (e.g.
  `checkify.nan_checks` for NaNs produced inside fn); `jit_kwargs` go to `jax.jit`.

      loss = sse_jax.ops.checked(loss_fn)
      loss(params, batch)   # raises on the first bad op input

  The checks are added while fn is traced. Pass fn un-jitted: JAX caches the traces of
  jitted functions without regard to this mode, so one inside fn that was already
  traced outside `checked` keeps its unchecked trace (`jax.clear_caches()` forces a
  retrace), and one first traced here keeps its checks outside (harmless: dropped
  without checkify, but its calls leave JAX's fast dispatch path).
  """

  def fn_with_checks(*args, **kwargs):
    with _checking():
      return fn(*args, **kwargs)

  run = jax.jit(checkify.checkify(fn_with_checks, errors=errors), **jit_kwargs)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    err, out = run(*args, **kwargs)
    err.throw()
    return out

  return call


def check_state(name: str, state, expected: tuple[int, ...]) -> None:
  if state is None:
    return
  if not hasattr(state, "shape"):
    raise ValueError(f"{name} must be an array of shape {tuple(expected)}, got a "
                     f"{type(state).__name__}")
  if tuple(state.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(state.shape)}")
  check_floating(name, state)


def compute_dtype(*arrays) -> jnp.dtype:
  """float64 when any input is float64 (x64 tests), otherwise float32."""
  if any(a is not None and a.dtype == jnp.float64 for a in arrays):
    return jnp.dtype(jnp.float64)
  return jnp.dtype(jnp.float32)
