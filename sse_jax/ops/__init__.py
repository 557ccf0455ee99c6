"""The GLA / SSE operators: pure functions, one API, several implementations.

Notation for shapes: B batch, T time, H heads, Dk key/query dim, Dv value dim,
N routed partitions, K partitions selected per token (top-k), S packed sequences
(`cu_seqlens`), C chunk length.

    gla(q, k, v, g, ...)                                  -> (o, final_state)
    sse(q, k, v, g, weights, indices, num_partitions=N)   -> (o, final_state)
    sse_decode_step(q, k, v, g, weights, indices, state)  -> (o, new_state)
    gla_decode_step(q, k, v, g, state)                    -> (o, new_state)

`impl` picks the implementation (see `Impl`); all compute the same function.
`checked(fn)` runs jitted code with the ops' input checks (values under jit).
"""

from sse_jax.ops.checks import Gate, checked
from sse_jax.ops.decode import gla_decode_step, sse_decode_step
from sse_jax.ops.gla import gla
from sse_jax.ops.impl import GLA_IMPLS, SSE_IMPLS, Impl
from sse_jax.ops.sse import sse

__all__ = ["Gate", "Impl", "GLA_IMPLS", "SSE_IMPLS", "checked", "gla", "gla_decode_step",
           "sse", "sse_decode_step"]
