"""Issue 8's simulator target on the terminal preset (the rules and the list of misses: `tests/sim_bound_cases.py`)."""

from __future__ import annotations

import pytest

from tests.sim_bound_cases import cases, check_case, check_search

PRESET = "terminal"


@pytest.mark.slow
@pytest.mark.parametrize(("eta", "cells"), cases(PRESET))
def test_elastic_within_5_percent_of_the_bound(eta: int, cells: int) -> None:
    check_case(PRESET, eta, cells)


@pytest.mark.extended
@pytest.mark.parametrize("cells", range(2, 9))
def test_the_listed_winner_is_still_the_fastest_setting_at_eta_1(cells: int) -> None:
    check_search(PRESET, cells)
