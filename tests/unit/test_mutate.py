"""Every planted bug of ``tools/mutate.py`` still applies to the checkout: its line occurs exactly
once in its file and its test files exist (a refactor that moves a line makes the mutant silently
"not applicable", and the kill ratio then counts a bug nobody plants)."""

from pathlib import Path

import pytest

from tools.mutate import MUTANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name[:60])
def test_every_mutant_applies_to_the_checkout(mutant):
    src = ROOT / mutant.path
    assert src.is_file(), f"{mutant.name}: {mutant.path} is gone: point the mutant at the code now"
    count = src.read_text().count(mutant.old)
    assert count == 1, f"{mutant.name}: its line occurs {count} times in {mutant.path}: update the mutant"
    missing = [t for t in mutant.tests if not (ROOT / t).is_file()]
    assert not missing, f"{mutant.name}: its tests {missing} are gone (moved?): name them where they are"
