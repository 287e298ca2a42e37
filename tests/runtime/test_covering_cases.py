"""The harness's covering subset (tests/conftest.py, covering_cases): from 3 ranks on, each
parametrized test keeps the cases that bring a parameter value not yet seen, so every value of
every parameter still runs there."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import covering_cases

pytestmark = pytest.mark.serial


def fake_item(function: str, **indices: int) -> SimpleNamespace:
    """What covering_cases reads of a pytest item: its path, class, function name and callspec."""
    callspec = SimpleNamespace(params={name: f"value{i}" for name, i in indices.items()}, indices=indices) \
        if indices else None
    return SimpleNamespace(path=Path("tests/test_x.py"), cls=None, originalname=function, callspec=callspec,
                           name=f"{function}{indices}")


def test_every_value_of_every_parameter_is_kept_and_the_product_is_not():
    dtypes, layouts, solvers = range(2), range(2), range(3)
    items = [fake_item("test_solve", dtype=d, layout=l, solver=s)
             for d, l, s in itertools.product(dtypes, layouts, solvers)]
    kept = covering_cases(items)
    assert len(kept) < len(items)
    for name, values in (("dtype", dtypes), ("layout", layouts), ("solver", solvers)):
        assert {item.callspec.indices[name] for item in kept} == set(values)
    # Greedy in collection order: a case is kept when it brings a value no earlier case brought.
    assert [tuple(item.callspec.indices.values()) for item in kept] == [
        (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (1, 0, 0)]


def test_functions_are_covered_separately_and_unparametrized_tests_always_run():
    items = [fake_item("test_a", n=0), fake_item("test_a", n=0), fake_item("test_b", n=0), fake_item("test_plain")]
    kept = covering_cases(items)
    assert kept == [items[0], items[2], items[3]]
