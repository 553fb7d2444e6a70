"""The mutation check's planted bugs still name code that exists: a mutation whose text
moved away plants nothing, and ``python -m specrag.evals.checks.mutation_check`` would only say so when
someone runs it."""

from __future__ import annotations

import pytest

from specrag.evals.checks.mutation_check import MUTATIONS, ROOT, Mutation


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[mutation.name for mutation in MUTATIONS])
def test_every_planted_bug_edits_exactly_one_place(mutation: Mutation) -> None:
    count = (ROOT / mutation.path).read_text().count(mutation.old)
    assert count == 1, f"{mutation.name}: its text occurs {count} times in {mutation.path}"
    for test in mutation.tests:
        assert (ROOT / test.split("::")[0]).is_file()
