"""A sample manifest of a TP (x PP) checkpoint, built without saving anything; a saved one edited."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_sharded_loader.format import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    RankEntry,
    SourceModel,
    TensorEntry,
    default_pattern,
    render_file_name,
)


def sample_manifest(tp=2, pp=1) -> Manifest:
    ranks = []
    for p in range(pp):
        for t in range(tp):
            name = render_file_name(default_pattern(pp), tp_rank=t, pp_rank=p, part=0)
            ranks.append(
                RankEntry(
                    t,
                    p,
                    (FileEntry(name, 1234),),
                    {"w": TensorEntry(name, "BF16", (4, 8)), "b": TensorEntry(name, "F32", ())},
                )
            )
    return Manifest(
        tp_size=tp,
        pp_size=pp,
        dtype="bfloat16",
        pattern=default_pattern(pp),
        source=SourceModel("LlamaForCausalLM", "ab" * 32, {"hidden_size": 8}),
        ranks=tuple(ranks),
    )


def edit_manifest(directory: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite ``directory``'s manifest with ``edit`` applied to its JSON, as a hand edit or a hostile
    writer would (the result need not parse)."""
    path = directory / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
