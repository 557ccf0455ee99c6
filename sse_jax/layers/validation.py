"""Config validation: every error is a ValueError naming the field and its value.

Layer configs call these from `validate()` (and from `__post_init__`, so a bad
config fails where it is written, not deep inside a traced model).
"""

from __future__ import annotations

from typing import Any, Iterable


def fail(owner: str, field: str, value: Any, why: str) -> None:
  raise ValueError(f"{owner}.{field}={value!r} {why}")


def positive_int(owner: str, field: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    fail(owner, field, value, "must be a positive int")


def nonnegative_int(owner: str, field: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    fail(owner, field, value, "must be an int >= 0")


def optional_positive_int(owner: str, field: str, value: Any) -> None:
  if value is not None:
    positive_int(owner, field, value)


def positive_float(owner: str, field: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
    fail(owner, field, value, "must be a positive number")


def boolean(owner: str, field: str, value: Any) -> None:
  if not isinstance(value, bool):
    fail(owner, field, value, "must be a bool")


def choice(owner: str, field: str, value: Any, choices: Iterable[Any]) -> None:
  choices = tuple(choices)
  if value not in choices:
    fail(owner, field, value, f"is not one of {', '.join(map(repr, choices))}")


def divides(owner: str, field: str, value: int, divisor_field: str, divisor: int) -> None:
  if value % divisor:
    fail(owner, field, value, f"is not divisible by {divisor_field}={divisor}")
