"""The notebooks in notebooks/ run: each executes headless, top to bottom, on the CPU in
small mode (SSE_NOTEBOOK_SIZE=small) and fails on any cell error, including the asserts
the notebooks make about what they show. The committed files carry no outputs.

They run against the pip-installed package, as in Colab after the first cell: the kernel
(this interpreter, through a kernelspec written to a temp dir) starts in a temp dir with
PYTHONPATH unset, so `sse_jax` is what the install resolves to (the repository's
`pip install -e .`, as the README's commands and CI do), and the first cell finds the
checkout beside that editable install for `configs` and `experiments`, which are not
installed. The first cell is the same in every notebook: the install from REPO_URL or a
local checkout, the accelerator and the impl that `auto` picks, and SIZE (small on a
CPU). As in test_train_runs, XLA:CPU compiles with the session's cheap-compile flags
(conftest.py; compiles dominate these small runs) into a persistent compilation cache
shared with the other tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
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
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(
      SSE_NOTEBOOK_SIZE="small", JAX_PLATFORMS="cpu",
      MPLBACKEND="module://matplotlib_inline.backend_inline",  # figures become outputs
      XLA_FLAGS=os.environ.get("XLA_FLAGS", "--xla_backend_optimization_level=0"))
  yield env
  mp.undo()


@pytest.fixture(scope="module")
def installed(kernel_env, tmp_path_factory) -> pathlib.Path:
  """Where `import sse_jax` resolves outside the repository, with PYTHONPATH unset."""
  proc = subprocess.run([sys.executable, "-c", "import sse_jax; print(sse_jax.__file__)"],
                        cwd=tmp_path_factory.mktemp("elsewhere"), env=kernel_env,
                        capture_output=True, text=True, timeout=120)
  if proc.returncode != 0:
    pytest.fail("the notebooks run against the installed package, and sse_jax is not"
                " installed: pip install -e . from the repository root")
  package = pathlib.Path(proc.stdout.strip()).resolve().parent
  assert package == REPO / "sse_jax", (
      f"the installed sse_jax is {package}, not this checkout's: pip install -e . here")
  return package


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
  assert first.cell_type == "code", f"{name}: the first cell is the set-up"
  for words in ('REPO_URL = "https://github.com/OWNER/sse-jax"  # <-- EDIT', "pip",
                "resolve_auto", "SSE_NOTEBOOK_SIZE"):
    assert words in first.source, (name, words)
  reference = nbformat.read(NOTEBOOKS / EXPECTED[0], as_version=4).cells[0].source
  assert first.source == reference, f"{name}: the set-up cell differs from {EXPECTED[0]}'s"


@pytest.mark.parametrize("name", ALL)
def test_notebook_executes_in_small_mode(name, kernel_env, installed, tmp_path):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  env = dict(kernel_env, SSE_NOTEBOOK_WORKDIR=str(tmp_path / "workdir"))
  cwd = tmp_path / "cwd"  # not the repository: nothing is imported from the working dir
  cwd.mkdir()
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                          resources={"metadata": {"path": str(cwd)}})
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
  setup = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.output_type == "stream")
  assert f"from {installed}\n" in setup, setup  # the installed package, nothing installed
  assert "installing" not in setup and "SIZE = 'small'" in setup, setup
  assert "impl='auto' runs gla as 'chunk' and sse as 'varlen'" in setup, setup  # a CPU
