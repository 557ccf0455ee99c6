"""Pallas GPU kernels (Triton lowering); run in interpret mode on CPU for tests."""
