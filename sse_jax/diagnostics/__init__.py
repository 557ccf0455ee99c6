"""State diagnostics of a trained model (docs/design.md, "State diagnostics"): row
similarity, singular-value energy entropy, small key entries and receptive field of every
recurrent layer's states, and the SSE router's write/read agreement.

    from sse_jax import diagnostics
    layers = diagnostics.trace(model, tokens)          # states, keys, decays per layer
    stats = diagnostics.LayerStats(0, "sse"); stats.add(layers[0], tokens != 0)
    stats.result()                                      # the numbers

`measures` holds the definitions as functions over arrays; `experiments.diagnostics` runs
them on a training run's checkpoint and draws the figures.
"""

from sse_jax.diagnostics.measures import (agreement_chance, energy_entropy,
                                          off_diagonal_mean, receptive_field, row_cosine,
                                          row_similarity, small_key_counts,
                                          small_key_fraction)
from sse_jax.diagnostics.stats import LayerStats
from sse_jax.diagnostics.trace import TYPES, LayerTrace, trace

__all__ = ["LayerStats", "LayerTrace", "TYPES", "agreement_chance", "energy_entropy",
           "off_diagonal_mean", "receptive_field", "row_cosine", "row_similarity",
           "small_key_counts", "small_key_fraction", "trace"]
