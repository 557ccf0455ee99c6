"""The README: its set-up commands are the ones CI runs, every `python` block in it runs
(each in a fresh namespace, as a reader would paste it), and it stays short."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Every ```python block is runnable (the README says so); shell commands are ```bash.
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
MAX_LINES = 260  # the README says what the project is; details live in docs/ and results/


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  commands = re.findall(r"^python3 -m pytest .*$", ci, flags=re.M)
  assert len(commands) == 1, commands
  assert commands[0] in README, f"README does not show the CI test command {commands[0]!r}"


def test_readme_has_the_op_and_model_examples():
  assert len(BLOCKS) >= 2, "README shows the op and the layer / model API in python blocks"
  assert "from sse_jax import ops" in BLOCKS[0]
  assert any("LanguageModel" in b for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
  exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})


def test_readme_is_short():
  lines = README.count("\n")
  assert lines <= MAX_LINES, f"README.md has {lines} lines: move details to docs/ or results/"
