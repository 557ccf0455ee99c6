"""The README's set-up commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  readme = (ROOT / "README.md").read_text()
  commands = re.findall(r"^python3 -m pytest .*$", ci, flags=re.M)
  assert len(commands) == 1, commands
  assert commands[0] in readme, f"README does not show the CI test command {commands[0]!r}"


def test_readme_python_example_runs():
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
  assert blocks, "README has no python example"
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})
