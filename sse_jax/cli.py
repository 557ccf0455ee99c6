"""Command-line helpers shared by `python -m sse_jax.train` and `python -m experiments.ablation`.

Both take an ml_collections config file, `--config=FILE[:ARG]` (the file's
`get_config(ARG)` builds the config), whose fields are set with dotted overrides,
`--config.<path>=<value>`. A mistake on the command line (a file that does not exist, a
config argument the file refuses, a field the config does not have) is one line on
stderr and exit status 2 (`usage_exit`), found before absl parses the flags (where it
would be a traceback): `load_config_file` builds the config, `check_override_paths`
checks every --config.<path> flag against it and suggests the closest field.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
import re
import sys
from typing import Any, Iterator, NoReturn

from absl import app
import ml_collections


def usage_exit(error: Exception | str) -> NoReturn:
  """Ends the program on a mistake of the user's: the message as one line on stderr,
  exit status 2 (absl would print a traceback, or its whole usage text)."""
  print(" ".join(str(error).split()), file=sys.stderr, flush=True)
  sys.exit(2)


def config_files(near: pathlib.Path) -> list[str]:
  """The config files beside `near` (else in configs/): those with a get_config, for the
  message about a config file that does not exist."""
  for folder in (near.parent, pathlib.Path("configs")):
    if folder.is_dir():
      found = [str(f) for f in sorted(folder.glob("*.py"))
               if re.search(r"^def get_config\(", f.read_text(errors="replace"), re.M)]
      if found:
        return found
  return []


def load_config_file(argument: str) -> ml_collections.ConfigDict:
  """The config that --config=<file>[:<arg>] names, as its file builds it (no
  --config.* flags applied). A file that does not exist, has no get_config or fails to
  build a ConfigDict is an app.UsageError naming the flag; a ValueError of get_config is
  taken as its word on the argument."""
  path, *arg = argument.split(":", 1)
  file = pathlib.Path(path)
  if not file.is_file():
    known = config_files(file)
    raise app.UsageError(f"--config={argument}: no such config file"
                         + (f"; the configs are {', '.join(known)}" if known else ""))
  spec = importlib.util.spec_from_file_location("_cli_config", file)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # as an import would: e.g. dataclasses look it up
  try:
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
      raise app.UsageError(f"--config={argument}: not a config file (it has no get_config)"
                           + "".join(f"; the configs are {', '.join(known)}"
                                     for known in [config_files(file)] if known))
    cfg = module.get_config(*arg)
  except app.UsageError:
    raise
  except ValueError as e:  # the config's own word on its argument
    raise app.UsageError(f"--config={argument}: {e}") from None
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise app.UsageError(f"--config={argument}: building the config failed: "
                         f"{type(e).__name__}: {e}") from None
  finally:
    del sys.modules[spec.name]
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise app.UsageError(f"--config={argument}: get_config() returned a "
                         f"{type(cfg).__name__}, not an ml_collections.ConfigDict")
  return cfg


def config_argument(args: list[str]) -> str | None:
  """The value of the last --config flag in `args` (before a `--`), or None."""
  args = args[:args.index("--")] if "--" in args else args
  argument = None
  for i, arg in enumerate(args):
    found = re.fullmatch(r"--?config(?:=(.*))?", arg, re.S)
    if found:
      argument = found[1] if found[1] is not None else next(iter(args[i + 1:]), None)
  return argument


def field_paths(node, prefix: str = "") -> Iterator[str]:
  """Every dotted path a --config.<path> flag can name in a config (groups included)."""
  for key, value in node.items():
    path = f"{prefix}.{key}" if prefix else key
    yield path
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      yield from field_paths(value, path)


def _value_at(cfg, path: str) -> Any:
  node = cfg
  for key in path.split("."):
    node = node[key]
  return node


def check_override_paths(args: list[str], argument: str, cfg) -> None:
  """Checks that every --config.<path> flag in `args` names a field of `cfg` (the config
  --config=`argument` built) that a flag can set; an app.UsageError names the flag and
  the closest field (e.g. --config.model.sse.top_k: --config.train.model.sse.top_k)."""
  args = args[:args.index("--")] if "--" in args else args
  paths = set(field_paths(cfg))
  for arg in args:
    found = re.match(r"--?(?:no)?config\.([^=]*)", arg)
    if not found or "[" in found[1]:  # [i]: config_flags' indexing
      continue
    path = found[1]
    parts = path.split(".")
    unset = next((".".join(parts[:n]) for n in range(1, len(parts) + 1)
                  if ".".join(parts[:n]) in paths
                  and _value_at(cfg, ".".join(parts[:n])) is None), None)
    if unset is not None:
      raise app.UsageError(f"{arg}: {unset} is None in {argument}, and a flag cannot set a"
                           " field that is None: set it in a config file")
    if path in paths:
      continue
    tails = sorted((p for p in paths if p.endswith("." + path)), key=len)
    heads = [".".join(parts[n:]) for n in range(1, len(parts))
             if ".".join(parts[n:]) in paths]  # e.g. train.lr in a training config: lr
    close = tails or heads or difflib.get_close_matches(path, sorted(paths), n=1)
    hint = (f"; did you mean --config.{close[0]}?" if close else
            f"; its fields are {', '.join(sorted(cfg))}")
    raise app.UsageError(f"{arg}: {argument} has no field {path}{hint}")
