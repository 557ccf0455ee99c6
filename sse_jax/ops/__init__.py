"""The GLA / SSE operators: pure functions, one API, several implementations.

Notation for shapes: B batch, T time, H heads, Dk key/query dim, Dv value dim,
N routed partitions, K partitions selected per token (top-k), S packed sequences
(`cu_seqlens`), C chunk length. The mathematics: docs/design.md, section 1.

    gla(q, k, v, g, ...)                                  -> (o, final_state)
    sse(q, k, v, g, weights, indices, num_partitions=N)   -> (o, final_state)
    sse_decode_step(q, k, v, g, weights, indices, state)  -> (o, new_state)
    gla_decode_step(q, k, v, g, state)                    -> (o, new_state)
    chunk_gla / fused_recurrent_gla                       fla's signatures (`fla_api`)
    gdn(q, k, v, g, beta, ...)                            -> (o, final_state)
    sse_gdn(q, k, v, g, beta, weights, indices, ...)      -> (o, final_state)
    gdn_decode_step / sse_gdn_decode_step                 one token (delta rule)

gdn and sse_gdn are the gated delta rule (Gated DeltaNet) and SSE over delta-rule
partitions (docs/design.md, section 7); their `impl` strings are GDN_IMPLS and
SSE_GDN_IMPLS (the Pallas forms run `pallas_kernels.chunk_gdn`), or a typed `Plan`.

`impl` picks the implementation: an `Impl` string ("chunk", "pallas_varlen", "auto",
...) or a typed `Plan` (an `Algorithm` and a chunk core, `XlaCore` or `PallasCore`
with its block sizes and interpret flag); all compute the same function
(docs/design.md, section 3). `checked(fn)` runs jitted code with the ops' input checks
(values under jit).
"""

from sse_jax.ops.checks import Gate, checked
from sse_jax.ops.decode import gla_decode_step, sse_decode_step
from sse_jax.ops.fla_api import chunk_gla, fused_recurrent_gla
from sse_jax.ops.gdn import GDN_IMPLS, gdn, gdn_decode_step
from sse_jax.ops.gla import gla
from sse_jax.ops.impl import GLA_IMPLS, SSE_IMPLS, Algorithm, Impl, PallasCore, Plan, XlaCore
from sse_jax.ops.sse import sse
from sse_jax.ops.sse_gdn import SSE_GDN_IMPLS, sse_gdn, sse_gdn_decode_step

__all__ = ["Algorithm", "GDN_IMPLS", "Gate", "Impl", "GLA_IMPLS", "PallasCore", "Plan",
           "SSE_GDN_IMPLS", "SSE_IMPLS", "XlaCore", "checked", "chunk_gla",
           "fused_recurrent_gla", "gdn", "gdn_decode_step", "gla", "gla_decode_step", "sse",
           "sse_decode_step", "sse_gdn", "sse_gdn_decode_step"]
