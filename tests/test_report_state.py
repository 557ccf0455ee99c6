"""experiments.report's recurrent state per layer for the sliding-window ("W") and MoM
("M") letters, against sizes worked out by hand."""

from __future__ import annotations

import pytest

from experiments import report
from sse_jax.model import ModelConfig


def _model(pattern: str, **mixers) -> ModelConfig:
  return ModelConfig.create(pattern=pattern, vocab_size=32, hidden=64, num_heads=2,
                            mlp_dim=128, **mixers)


def test_sliding_window_state_is_its_ring_cache():
  """W = 8, Hkv = 2, Dh = 32: keys and values of min(T, W) positions, 2 x 8 x 2 x 32 =
  1024 floats at T >= W, 2 x 4 x 2 x 32 = 512 at T = 4, and W positions when T is
  unknown (the ring does not grow); GQA counts the KV heads only."""
  swa = _model("W", swa=dict(window=8)).mixer_config("W")
  assert report.layer_state("W", swa, 32) == (1024, 1024)
  assert report.layer_state("W", swa, 4) == (512, 512)
  assert report.layer_state("W", swa, None) == (1024, 1024)
  gqa = _model("W", swa=dict(window=8, num_kv_heads=1)).mixer_config("W")
  assert report.layer_state("W", gqa, 32) == (512, 512)


def test_full_attention_state_still_needs_the_sequence_length():
  attention = _model("A").mixer_config("A")
  assert report.layer_state("A", attention, 16) == (2 * 16 * 2 * 32,) * 2
  assert report.layer_state("A", attention, None) is None


@pytest.mark.parametrize("shared, active, total", [(True, 2 * 512, 5 * 512),
                                                    (False, 512, 4 * 512)])
def test_mom_state_counts_active_and_total_memories(shared, active, total):
  """N = 4 memories, k = 1, H = 2, Dk = 8, Dv = 32: 2 x 8 x 32 = 512 floats a memory;
  a token writes k of them (+ the shared one), the layer keeps N (+ 1)."""
  mom = _model("M", mom=dict(num_memories=4, top_k=1, key_dim=8,
                             shared_memory=shared)).mixer_config("M")
  assert report.layer_state("M", mom, 64) == (active, total)
  assert report.layer_state("M", mom, None) == (active, total)
  two = _model("M", mom=dict(num_memories=4, top_k=2, key_dim=8)).mixer_config("M")
  assert report.layer_state("M", two, None) == (3 * 512, 5 * 512)


def test_state_floats_and_family_of_models_with_the_new_letters():
  """The largest layer decides: a window of 128 at T = 64 caches 2 x 64 x 2 x 32 = 8192
  floats, more than the MoM layer's 2560 total; without T the window's 128 positions."""
  model = _model("MW", swa=dict(window=128), mom=dict(num_memories=4, top_k=1, key_dim=8))
  assert report.state_floats(model, 64) == dict(state_floats_active=8192,
                                                state_floats_total=8192)
  assert report.state_floats(model, None) == dict(state_floats_active=16384,
                                                  state_floats_total=16384)
  mom = _model("MM", mom=dict(num_memories=4, top_k=1, key_dim=8))
  assert report.state_floats(mom, None) == dict(state_floats_active=1024,
                                                state_floats_total=2560)
  assert report.family_of("MM") == "mom" and report.family_of("WW") == "swa"
  assert report.family_of("SWSWA") == "hybrid"


def test_unknown_letter_is_one_line_error():
  with pytest.raises(ValueError, match="unknown mixer letter 'X'"):
    report.layer_state("X", None, 8)
