"""The notebooks in notebooks/ run: each executes headless, top to bottom, on the CPU in
small mode (SSE_NOTEBOOK_SIZE=small) and fails on any cell error, including the asserts
the notebooks make about what they show. The committed files carry no outputs.

The kernel is this interpreter (a kernelspec written to a temp dir), started in the
repository root with the root on PYTHONPATH, so it imports the working tree's package
(and `configs`, `experiments`) whether or not it is installed. As in test_train_runs,
XLA:CPU compiles with LLVM optimisation off (compiles dominate these small runs) into a
persistent compilation cache shared with the other tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time

import nbformat
import pytest
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
EXPECTED = ("01_quickstart.ipynb", "02_ablation.ipynb", "03_kernels.ipynb")
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))  # every notebook is executed
KERNEL = "sse-jax-notebook-test"
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory) -> dict[str, str]:
  """Environment of the notebook kernels; registers the kernelspec for this process."""
  spec_root = tmp_path_factory.mktemp("jupyter")
  spec = spec_root / "kernels" / KERNEL
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "sse-jax tests", "language": "python"}))
  mp = pytest.MonkeyPatch()  # the kernelspec lookup (in this process) reads JUPYTER_PATH
  mp.setenv("JUPYTER_PATH", os.pathsep.join(
      p for p in (str(spec_root), os.environ.get("JUPYTER_PATH")) if p))
  cache = os.environ.get("SSE_JAX_TEST_CACHE",
                         os.path.join(tempfile.gettempdir(), "sse_jax_test_jax_cache"))
  env = dict(os.environ)
  env.update(
      SSE_NOTEBOOK_SIZE="small", JAX_PLATFORMS="cpu",
      MPLBACKEND="module://matplotlib_inline.backend_inline",  # figures become outputs
      XLA_FLAGS="--xla_backend_optimization_level=0",
      PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
      JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
      JAX_COMPILATION_CACHE_MAX_SIZE=str(1 << 30))
  yield env
  mp.undo()


def test_the_notebooks_are_there():
  assert set(EXPECTED) <= set(ALL), ALL


@pytest.mark.parametrize("name", ALL)
def test_committed_notebook_is_clean(name):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  nbformat.validate(nb)
  assert nb.nbformat == 4
  assert nb.metadata["kernelspec"]["language"] == "python"
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [], f"{name} cell {i} has outputs: clear them before committing"
      assert cell.execution_count is None, f"{name} cell {i} has an execution count"
  first = nb.cells[0]
  assert first.cell_type == "code" and "# !pip install" in first.source, (
      f"{name}: the first cell installs the package (commented for local use)")
  assert any("SSE_NOTEBOOK_SIZE" in c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("name", ALL)
def test_notebook_executes_in_small_mode(name, kernel_env, tmp_path):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  env = dict(kernel_env, SSE_NOTEBOOK_WORKDIR=str(tmp_path / "workdir"))
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                          resources={"metadata": {"path": str(REPO)}})
  start = time.time()
  client.execute(env=env)  # raises CellExecutionError, with the cell and traceback, on error
  seconds = time.time() - start
  print(f"{name}: executed in {seconds:.1f} s")
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]
  assert not errors
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "image/png" in o.get("data", {})]
  assert images, f"{name} drew no figure"
