"""MkDocs hook: the benchmark charts live in ``benchmarks/results/``, next to the data that
makes them; the site serves them as ``results/*.png`` without a copy in ``docs/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks"


def on_files(files: Files, config: Any) -> Files:
    for chart in sorted((RESULTS / "results").glob("*.png")):
        files.append(
            File(
                f"results/{chart.name}",
                src_dir=str(RESULTS),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
