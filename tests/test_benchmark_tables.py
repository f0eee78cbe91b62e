"""The documentation's benchmark tables are the recorded results, generated (issue 28).

`python -m benchmarks.tables` writes every table `docs/benchmarks.md` (and the README's headline
figures) quote from a benchmark run out of `benchmarks/results/latest.json`; a hand edit of a
figure, or a rerun whose results were committed without regenerating the pages, fails here.
"""

from __future__ import annotations

import copy
import json

from benchmarks import tables

BENCHMARKS_PAGE = tables.REPO / "docs" / "benchmarks.md"


def test_the_pages_tables_are_generated_from_the_recorded_results() -> None:
    results = tables.load()
    for page in tables.PAGES:
        text = page.read_text()
        assert tables.render(text, results) == text, (
            f"{page.name}'s benchmark tables differ from benchmarks/results/latest.json: "
            "run python -m benchmarks.tables"
        )


def test_the_pages_hold_every_generated_table() -> None:
    """Deleting a block's markers would silently exempt its table from the check above."""
    names = [name for page in tables.PAGES for name in tables.block_names(page.read_text())]
    assert sorted(names) == sorted(tables.TABLES)


def test_the_benchmarks_page_and_the_readme_hold_their_tables() -> None:
    """The methods' page keeps the full tables; the README only its headline cut of them."""
    assert tables.block_names((tables.REPO / "README.md").read_text()) == ["headline"]
    assert BENCHMARKS_PAGE in tables.PAGES


def test_a_changed_result_changes_the_rendered_pages() -> None:
    """The negative control: the check compares figures, not just the blocks' presence."""
    payload = json.loads(tables.RESULTS.read_text())
    changed = copy.deepcopy(payload)
    for ratio in changed["benchmarks"]["async_commit"]["ratios"]:
        ratio["median"] *= 1.5
    for page in tables.PAGES:
        text = page.read_text()
        assert tables.render(text, tables.Results(changed)) != text, page
        assert tables.render(text, tables.Results(payload)) == text, page


def test_the_recorded_run_holds_the_latency_ratio_of_asynchronous_pauses() -> None:
    """Issue 28: the pause with +50 ms per S3 request over the pause without, interleaved in
    one run, is recorded (not derived by hand from two separately measured medians)."""
    results = tables.load()
    for states in ("10000 x 5 KB", "1000 x 50 KB"):
        name = f"{states}: async pause, SeaweedFS +50 ms/request / SeaweedFS"
        assert results.ratio("async_commit", name) > 0
