"""Pallas GPU kernels (Triton lowering); run in interpret mode on CPU for tests.

  chunk_gla  chunked gated linear attention (GLA / SSE)
  chunk_gdn  chunked gated delta rule (GDN / SSE-GDN)
  move_rows  row gathers of the varlen packing (slots into chunk-aligned buffers)
  slot_rows  the chunk kernels' operands read in place through the buffer's row table
"""
