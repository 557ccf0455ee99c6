"""The GLA / SSE operators: pure functions, one API, several implementations.

Notation for shapes: B batch, T time, H heads, Dk key/query dim, Dv value dim,
N routed partitions, K partitions selected per token (top-k), S packed sequences
(`cu_seqlens`), C chunk length. The mathematics: docs/design.md, section 1.

    gla(q, k, v, g, ...)                                  -> (o, final_state)
    sse(q, k, v, g, weights, indices, num_partitions=N)   -> (o, final_state)
    sse_decode_step(q, k, v, g, weights, indices, state)  -> (o, new_state)
    gla_decode_step(q, k, v, g, state)                    -> (o, new_state)
    chunk_gla / fused_recurrent_gla                       fla's signatures (`fla_api`)

`impl` picks the implementation: an `Impl` string ("chunk", "pallas_varlen", "auto",
...) or a typed `Plan` (an `Algorithm` and a chunk core, `XlaCore` or `PallasCore`
with its block sizes and interpret flag); all compute the same function
(docs/design.md, section 3). `checked(fn)` runs jitted code with the ops' input checks
(values under jit).
"""

from sse_jax.ops.checks import Gate, checked
from sse_jax.ops.decode import gla_decode_step, sse_decode_step
from sse_jax.ops.fla_api import chunk_gla, fused_recurrent_gla
from sse_jax.ops.gla import gla
from sse_jax.ops.impl import GLA_IMPLS, SSE_IMPLS, Algorithm, Impl, PallasCore, Plan, XlaCore
from sse_jax.ops.sse import sse

__all__ = ["Algorithm", "Gate", "Impl", "GLA_IMPLS", "PallasCore", "Plan", "SSE_IMPLS",
           "XlaCore", "checked", "chunk_gla", "fused_recurrent_gla", "gla",
           "gla_decode_step", "sse", "sse_decode_step"]
