"""``vllm-sharded``: the command line for sharded checkpoints.

    vllm-sharded verify DIR [--size-only]      check a checkpoint on disk, exit 0 if sound, 1 if not
    vllm-sharded save --model SRC -o DIR ...   what examples/save_sharded_state.py does

Errors are one clear line and a non-zero exit, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .format import ShardedStateError


def verify(args: argparse.Namespace) -> int:
    from .checkpoint import verify_checkpoint

    problems = verify_checkpoint(args.directory, checksums=not args.size_only)
    what = "sizes and headers" if args.size_only else "sizes, headers and checksums"
    if not problems:
        print(f"OK: {args.directory} is sound ({what} checked).")
        return 0
    print(f"BAD: {args.directory} has {len(problems)} problem(s):")
    for problem in problems:
        print(f"  - {problem}")
    return 1


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-sharded", description="Per-rank sharded checkpoints for vLLM.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("verify", help="check a checkpoint: manifest, files, sizes, headers, checksums")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--size-only", action="store_true", help="skip the checksums (what a load checks by default)")
    p.set_defaults(run=verify)
    commands.add_parser(
        "save",
        help="load a model in vLLM and save it sharded (same flags as examples/save_sharded_state.py)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["save"]:
            from .save_cli import main as save_main

            return save_main(argv[1:])
        args = make_parser().parse_args(argv)
        return args.run(args)
    except ShardedStateError as e:
        print(f"vllm-sharded: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
