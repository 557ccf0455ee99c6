"""experiments.saved_residuals: the residuals of a tiny model's training loss, by source
line, and what the Pallas ops' checkpoint policy leaves out of them."""

import jax

from experiments import saved_residuals
from sse_jax.ops import impl


def _op_bytes(rows):
  return sum(r["bytes"] for r in rows if r["source"].startswith("sse_jax/ops/"))


def test_kernel_ops_keep_only_their_kernels_residuals(monkeypatch):
  """Under the Pallas core the SSE op's chunked path runs under a checkpoint that saves
  only the kernels' named results and the packing's index tables
  (`impl.keep_kernel_residuals`); without it the op also keeps the packed copies of q,
  k, v and the gates (at this tiny size about as much again)."""
  kept = _op_bytes(saved_residuals.residuals("sse", "tiny", 64, kernels=True))
  monkeypatch.setattr(impl, "keep_kernel_residuals", lambda fn, core: fn)
  jax.clear_caches()  # the ops' traces were made with the policy
  everything = _op_bytes(saved_residuals.residuals("sse", "tiny", 64, kernels=True))
  jax.clear_caches()
  assert 0 < kept < 0.6 * everything, (kept, everything)


def test_report_totals_and_sources():
  root = saved_residuals.ROOT
  assert saved_residuals.relative(f"{root}/sse_jax/ops/sse.py:143:9 (sse)") == (
      "sse_jax/ops/sse.py:143:9 (sse)")
  assert saved_residuals.relative("/x/site-packages/jax/_src/lax/lax.py:1:2 (f)") == (
      "jax/_src/lax/lax.py:1:2 (f)")
  rows = [dict(shape=[2, 3], dtype="float32", bytes=24, source="a.py:1:1 (f)"),
          dict(shape=[4], dtype="bfloat16", bytes=8, source="b.py:2:1 (g)"),
          dict(shape=[12], dtype="bfloat16", bytes=24, source="b.py:2:1 (g)")]
  assert saved_residuals.by_source(rows) == [("b.py:2:1 (g)", 32, 2), ("a.py:1:1 (f)", 24, 1)]
  half = [dict(r, bytes=r["bytes"] // 2) for r in rows]
  text = saved_residuals.report({"a": rows, "b": half}, 1, "header")
  assert text.startswith("header") and "| a | 0.0 | 3 | 1.000x |" in text
  assert "| b | 0.0 | 3 | 0.500x |" in text
  assert text.count("largest source lines") == 2 and text.count("| `") == 2
