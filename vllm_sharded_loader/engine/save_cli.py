"""Save a model as a sharded checkpoint: the job of ``examples/save_sharded_state.py``.

Same command line as vLLM's example, plus ``--output/-o``, ``--file-pattern`` and ``--max-file-size``.
Each worker captures its loaded state during start-up (:mod:`.capture`); vLLM's save hook publishes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..checkpoint.loaded_state import CAPTURE_DIR_ENV, CAPTURE_MAX_SIZE_ENV, CAPTURE_PATTERN_ENV, OVERWRITE_ENV
from ..checkpoint.save import DEFAULT_MAX_SIZE
from ..format.errors import InvalidOption
from ..storage.location import Store, open_store, read_manifest
from ..storage.model_files import special_files
from .vllm_versions import require_supported


def engine_kwargs(engine_args: Any) -> dict[str, Any]:
    """``LLM(**kwargs)`` arguments equal to parsed ``EngineArgs``; shallow, since ``asdict`` would turn
    nested configs into dicts vLLM fails to validate."""
    return {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}


def make_parser() -> argparse.ArgumentParser:
    """vLLM's EngineArgs flags plus the save options."""
    from vllm import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        type=str,
        help="directory (or s3://, gs://, az:// prefix) to write the checkpoint to",
    )
    parser.add_argument(
        "--file-pattern",
        type=str,
        default=None,
        help="file name pattern of the parts (default: vLLM's, "
        "model-rank-{rank}-part-{part}.safetensors or model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors)",
    )
    parser.add_argument(
        "--max-file-size",
        type=int,
        default=DEFAULT_MAX_SIZE,
        help="maximum size of one part in bytes; a larger single tensor gets a part of its own (default 5 GiB)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint already in --output (default: refuse)"
    )
    return parser


def save_sharded_state(
    engine_kwargs: dict[str, Any],
    output: str | Store,
    pattern: str | None = None,
    max_size: int | None = DEFAULT_MAX_SIZE,
    overwrite: bool = False,
) -> Any:
    """Load ``engine_kwargs['model']`` in an engine and save it sharded to ``output`` (a folder, URL or store).

    Returns the engine (an ``LLM``), so a caller can generate with it too. Call from
    under ``if __name__ == "__main__":``: vLLM starts its workers with spawn.
    """
    require_supported()  # the plugin off, vLLM's save hook would write vLLM's own format
    model = engine_kwargs["model"]
    if not os.path.isdir(model):
        raise InvalidOption(f"--model {model!r} must be a local directory holding the source model.")
    for error in special_files(model):
        raise error
    store = open_store(output)
    # Refused now if its lock would refuse it, before an engine starts for nothing.
    with store.capture_folder(model, overwrite) as capture_dir:
        return _save(engine_kwargs, store, capture_dir, pattern, max_size, overwrite)


def _save(
    engine_kwargs: dict[str, Any],
    store: Store,
    capture_dir: str,
    pattern: str | None,
    max_size: int | None,
    overwrite: bool,
) -> Any:
    os.environ[CAPTURE_DIR_ENV] = capture_dir
    os.environ[CAPTURE_PATTERN_ENV] = pattern or ""
    os.environ[CAPTURE_MAX_SIZE_ENV] = "" if max_size is None else str(max_size)
    os.environ[OVERWRITE_ENV] = "1" if overwrite else ""

    from vllm import LLM

    try:
        llm = LLM(**engine_kwargs)
        llm.llm_engine.engine_core.save_sharded_state(path=store.canonical(), pattern=pattern, max_size=max_size)
    finally:
        for name in (CAPTURE_DIR_ENV, CAPTURE_PATTERN_ENV, CAPTURE_MAX_SIZE_ENV, OVERWRITE_ENV):
            os.environ.pop(name, None)
    return llm


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``examples/save_sharded_state.py``."""
    from vllm import EngineArgs

    args = make_parser().parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    started = time.perf_counter()
    # The artifacts this save carries are then the ones a prepared node looks up.
    from .node_setup import prefer_inductor_caches

    prefer_inductor_caches()
    try:
        llm = save_sharded_state(
            engine_kwargs(engine_args), args.output, args.file_pattern, args.max_file_size, args.overwrite
        )
    except Exception as e:  # ours, or vLLM's wrapping of a worker's: the message is what matters, not our stack
        print(f"error: {e}", *getattr(e, "__notes__", []), sep="\n", file=sys.stderr, flush=True)
        return 2
    manifest = read_manifest(args.output)
    assert manifest is not None
    print(
        f"Saved {engine_args.model} to {args.output}: TP={manifest.tp_size} PP={manifest.pp_size}, "
        f"{sum(len(r.files) for r in manifest.ranks)} files, {manifest.nbytes / 1e6:.1f} MB, "
        f"in {time.perf_counter() - started:.1f} s (engine start included)."
    )
    del llm
    return 0
