"""The fla peer benchmark measures the ops the JAX benchmark measures, and nothing else
(each of fla's ops autotunes for minutes on its first call)."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from sse_jax import ops


def _run(code: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300)


def test_bench_ops_passes_only_the_ops_it_measures():
  code = ("from absl import flags; from experiments import bench_ops; "
          "flags.FLAGS(['x', {}]); print(bench_ops.peer_ops())")
  done = _run(code.format("'--gla_impls=', '--sse_impls='"))
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "['gdn', 'sse_gdn']"
  done = _run(code.format("'--gdn_impls=', '--sse_gdn_impls=', '--sse_impls='"))
  assert done.stdout.strip() == "['gla']", done.stderr[-2000:]


def _assert_refused(module: str, arg: str, message: str):
  """`python -m module arg` exits 2 with `message`, before importing torch."""
  done = subprocess.run([sys.executable, "-m", module, "--out=unused", arg],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  assert message in done.stderr
  assert "importing torch" not in done.stderr


def test_bench_fla_refuses_an_unknown_op_before_importing_torch():
  _assert_refused("experiments.bench_fla", "--ops=gdn,delta",
                  "--ops='gdn,delta': choose from gla,sse,gdn,sse_gdn")


def test_bench_fla_e2e_refuses_an_unknown_variant_before_importing_torch():
  _assert_refused("experiments.bench_fla_e2e", "--variants=gla,gdn",
                  "--variants='gla,gdn': choose from gla,sse")


def test_load_layer_skips_the_layers_package_init(tmp_path):
  """fla.layers' __init__ imports every layer (some need transformers): load_layer reads
  one layer file without it, and names the missing authors' file in one line."""
  layers = tmp_path / "fla" / "layers"
  layers.mkdir(parents=True)
  (tmp_path / "fla" / "__init__.py").write_text("")
  (layers / "__init__.py").write_text("raise ImportError('the package init ran')\n")
  (layers / "utils.py").write_text("HELPER = 7\n")
  (layers / "gla.py").write_text("from fla.layers.utils import HELPER\nLAYER = HELPER * 6\n")
  code = ("import sys; sys.path.insert(0, {root!r}); from experiments import bench_fla_e2e as b; "
          "print(b.load_layer('gla').LAYER)\n"
          "try:\n  b.load_layer('sse')\nexcept FileNotFoundError as e:\n  print(e)")
  done = _run(code.format(root=str(tmp_path)))
  assert done.returncode == 0, done.stderr[-2000:]
  first, second = done.stdout.strip().splitlines()
  assert first == "42"
  assert second.endswith("copy its fla/layers/sse.py and fla/ops/sse/ over the installed fla")
  assert "sse.py not found" in second


def test_bench_fla_gdn_recurrence_matches_our_scan():
  """The float32 recurrence fla's GDN is checked against computes what ops.gdn does."""
  torch = pytest.importorskip("torch")
  from experiments import bench_fla  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  t, h, dk, dv = 13, 2, 4, 3
  q, k = rng.normal(size=(2, t, h, dk))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.normal(size=(t, h, dv))
  g = -rng.uniform(0, 0.5, size=(t, h))
  beta = rng.uniform(0, 1, size=(t, h))
  bounds = [0, 5, 13]
  got = bench_fla.gdn_recurrence(*(torch.tensor(a) for a in (q, k, v, g, beta)), bounds)
  want, _ = ops.gdn(*(jnp.asarray(a, jnp.float32)[None] for a in (q, k, v, g, beta)),
                    cu_seqlens=jnp.asarray(bounds), impl="scan")
  np.testing.assert_allclose(got.numpy(), np.asarray(want[0]), rtol=1e-5, atol=1e-5)


def test_bench_ops_notes_name_the_rows_and_their_errors():
  # In a subprocess, as above: bench_ops defines absl flags that other tools define too.
  code = """
from experiments import bench_ops
rows = [dict(source="fla (torch)", op="gdn", impl="chunk_gated_delta_rule", length=2048,
             n=None, note="timed despite", errors={"o": 1.5e-3, "dq": 0.25}),
        dict(source="fla (torch)", op="sse_gdn", impl="authors_gdn_varlen", length=2048,
             n=4, note="timed despite"),
        dict(source="sse-jax", op="gdn", impl="pallas_chunk", length=2048, n=None)]
print(bench_ops.notes(rows))
print("without notes:", repr(bench_ops.notes(rows[2:])))
"""
  done = _run(code)
  assert done.returncode == 0, done.stderr[-2000:]
  text = done.stdout
  assert ("- fla (torch) gdn chunk_gated_delta_rule, fla (torch) sse_gdn authors_gdn_varlen:"
          " timed despite") in text
  assert "fla (torch) gdn chunk_gated_delta_rule L=2048: o 1.5e-03, dq 2.5e-01" in text
  assert "pallas_chunk" not in text
  assert "without notes: ''" in text
