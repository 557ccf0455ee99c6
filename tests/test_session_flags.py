"""The test session's XLA flags: only flags this XLA starts with are set (an unknown one
aborts every test process before pytest can print a word)."""

import importlib.util
import pathlib


def _conftest():
  path = pathlib.Path(__file__).with_name("conftest.py")
  spec = importlib.util.spec_from_file_location("session_conftest", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_an_unknown_xla_flag_is_refused_and_a_known_one_accepted():
  conftest = _conftest()
  assert not conftest._xla_accepts("--xla_no_such_flag_in_any_release=1")
  assert conftest._xla_accepts("--xla_backend_optimization_level=0")
