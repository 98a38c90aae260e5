"""``vllm-sharded``: the command line for sharded checkpoints.

    vllm-sharded save --model SRC -o DIR ...   load a model in vLLM and save it sharded
    vllm-sharded inspect DIR [--json]          what a checkpoint holds
    vllm-sharded verify DIR [--size-only]      check a checkpoint on disk, exit 0 if sound, 1 if not
    vllm-sharded reshard DIR --tensor-parallel-size N [--pipeline-parallel-size M] --output OUT
                                               rewrite it for another topology, offline
    vllm-sharded convert SRC -tp N [-pp M] -o OUT
                                               write a Hugging Face model's per-rank files, no engine
    vllm-sharded keygen -o DIR                 a key pair to sign checkpoints with (private.pem, public.pem)
    vllm-sharded sign DIR --key PRIVATE.pem    sign a checkpoint: its start-up artifacts run where the key is trusted

Errors are one clear line and a non-zero exit, not a traceback.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
import unicodedata
from collections.abc import Sequence

from ..format.errors import InterruptedAfterPublish, ShardedStateError
from ..format.names import LOCK_NAME
from ..storage.progress import ByteProgress


def shown(text: str, keep: str = "") -> str:
    """``text`` with its control and format characters escaped but those in ``keep``: a name read from a
    checkpoint never prints as a line of its own or as terminal commands.

    >>> shown("model.norm.weight\\nLOCKED no \\x1b[2K")
    'model.norm.weight\\\\nLOCKED no \\\\x1b[2K'
    """
    return "".join(
        c.encode("unicode_escape").decode() if c not in keep and unicodedata.category(c)[0] == "C" else c for c in text
    )


class _ReaderGone(Exception):
    """Standard output's reader went away (``inspect DIR | head``): not an error."""


def _print(*args: object) -> None:
    """``print``, raising :class:`_ReaderGone` when the reader is gone."""
    try:
        print(*args)
    except BrokenPipeError:
        raise _ReaderGone from None


def _say(line: str) -> None:
    _print(shown(line))


def verify(args: argparse.Namespace) -> int:
    from ..checkpoint.verify import verify_checkpoint

    notes: list[str] = []
    with _progress("Verifying") as progress:
        problems = verify_checkpoint(args.store, checksums=not args.size_only, notes=notes, progress=progress)
    what = "sizes and headers" if args.size_only else "sizes, headers and checksums"
    # Leftovers of a dead save or engine are notes, not problems.
    for note in notes:
        _say(f"NOTE: {note}")
    if not problems:
        _say(f"OK: {args.directory} is sound ({what} checked).")
        return 0
    _say(f"BAD: {args.directory} has {len(problems)} problem(s):")
    for problem in problems:
        _say(f"  - {problem}")
    return 1


def inspect(args: argparse.Namespace) -> int:
    import json

    from .offline import inspect_checkpoint

    info = inspect_checkpoint(args.store)
    if args.json:
        _print(json.dumps(info, indent=1))  # (JSON escapes control characters itself)
        return 0
    files = [f for r in info["ranks"] for f in r["files"]]
    geometry = info["geometry"]
    _say(f"{info['directory']}")
    dp = f" DP={info['dp_size']}" if info["dp_size"] > 1 else ""
    _say(f"  topology      TP={info['tp_size']} PP={info['pp_size']}{dp}, pattern {info['pattern']}")
    if info["experts"]:
        writers = f", written by each of {info['replicas']} replicas" if info["replicas"] > 1 else ""
        _say(f"  experts       {info['experts']}{writers}")
    _say(f"  source model  {info['source']['architecture']} (config sha256 {info['source']['config_sha256'][:16]})")
    _say(f"  dtype         {info['dtype']}")
    _say(f"  tensors       {info['tensors']} names, {info['tensor_entries']} rank entries")
    _say(
        f"  files         {len(files)}, {info['bytes'] / 1e6:.1f} MB, checksums: {'yes' if info['checksums'] else 'no'}"
    )
    kinds = ", ".join(f"{k} {v}" for k, v in geometry["kinds"].items()) or "none"
    _say(f"  resharding    {'possible' if geometry['reshardable'] else 'not possible'} (geometry: {kinds})")
    if info["tied"]:
        _say(f"  tied          {'; '.join(' = '.join(g) for g in info['tied'])}")
    if info["locked"]:
        _say("  LOCKED        a save is running or was interrupted")
    carried = [r for r in info["ranks"] if r["startup_artifacts"]]
    _say(f"  start-up      {len(carried)} of {len(info['ranks'])} ranks carry compile artifacts")
    trust = info["trust"]
    _say(f"  signature     {'used here: ' if trust['trusted'] else 'not used here: '}{trust['reason']}")
    for r in info["ranks"]:
        dp = f" dp {r['dp_rank']}" if r["dp_rank"] else ""
        for f in r["files"]:
            _say(f"    pp {r['pp_rank']}{dp} tp {r['tp_rank']}  {f['name']:48s} {f['size']:>14,d} bytes")
        if r["startup_artifacts"]:
            a = r["startup_artifacts"]
            _say(f"    pp {r['pp_rank']}{dp} tp {r['tp_rank']}  {a['file']:48s} {a['size']:>14,d} bytes, for:")
            for name, value in a["key"].items():
                _say(f"        {name:18s} {value}")
    return 0


def _progress(action: str) -> ByteProgress:
    """A progress bar on standard error when it is a terminal (else only the closing line)."""
    return ByteProgress(action, enabled=sys.stderr.isatty(), line_per_update=False)


def reshard(args: argparse.Namespace) -> int:
    import time

    from .offline import reshard_checkpoint

    started = time.perf_counter()
    with _progress("Resharding") as progress:
        manifest = reshard_checkpoint(
            args.store,
            args.output,
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            max_size=args.max_file_size,
            overwrite=args.overwrite,
            progress=progress,
        )
    _print(
        f"Resharded {args.directory} to TP={manifest.tp_size} PP={manifest.pp_size} in {args.output}: "
        f"{sum(len(r.files) for r in manifest.ranks)} files, {manifest.nbytes / 1e6:.1f} MB, "
        f"{time.perf_counter() - started:.1f} s."
    )
    return 0


def convert(args: argparse.Namespace) -> int:
    import time

    from ..checkpoint.meta_model import ModelOptions
    from .convert import ConvertOptions, convert_checkpoint

    started = time.perf_counter()
    model = ModelOptions(args.dtype, args.quantization, args.trust_remote_code, args.runner, args.convert)
    options = ConvertOptions(model, args.revision, args.max_file_size, args.file_pattern, args.overwrite)
    with _progress("Converting") as progress:
        result = convert_checkpoint(
            args.source, args.output, args.tensor_parallel_size, args.pipeline_parallel_size, options, progress
        )
    manifest = result.manifest
    _print(
        f"Converted {args.source} to TP={manifest.tp_size} PP={manifest.pp_size} in {args.output}: "
        f"{sum(len(r.files) for r in manifest.ranks)} files, {manifest.nbytes / 1e6:.1f} MB from "
        f"{result.source_bytes / 1e6:.1f} MB of source weights, {time.perf_counter() - started:.1f} s: "
        f"written in {result.write_seconds:.1f} s after {result.build_seconds:.1f} s building vLLM's model."
    )
    return 0


def keygen(args: argparse.Namespace) -> int:
    from ..checkpoint.trust import TRUSTED_KEYS_ENV, keygen

    private, public = keygen(args.output)
    _say(f"Wrote {private} (keep it secret: it signs) and {public}.")
    _say(f"Sign with: SHARDED_STATE_SIGNING_KEY={private} (saves) or vllm-sharded sign DIR --key {private}.")
    _say(f"Trust on the serving nodes with: {TRUSTED_KEYS_ENV}={public}")
    return 0


def sign(args: argparse.Namespace) -> int:
    from ..checkpoint.startup_artifacts import sign_checkpoint
    from ..checkpoint.trust import check_trust, load_signer

    manifest = sign_checkpoint(args.store, load_signer(args.key))
    archives = sum(r.startup is not None for r in manifest.ranks)
    _say(f"Signed {args.directory} ({archives} start-up archives) with key {manifest.signature.short_id}.")
    verdict = check_trust(manifest)
    _say(f"Here: {'used' if verdict.trusted else 'not used'}, {verdict.reason}.")
    return 0


def _path(text: str) -> str:
    """A path argument; an empty one (``-o "$OUT"`` with OUT unset) would mean the working folder."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no folder; give the checkpoint's path")
    return text


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-sharded", description="Per-rank sharded checkpoints for vLLM.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("verify", help="check a checkpoint: manifest, files, sizes, headers, checksums")
    p.add_argument("directory", metavar="DIR", type=_path)
    p.add_argument("--size-only", action="store_true", help="skip the checksums (what a load checks by default)")
    p.set_defaults(run=verify)
    p = commands.add_parser("inspect", help="topology, files, dtype, tensors, source model, resharding geometry")
    p.add_argument("directory", metavar="DIR", type=_path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=inspect)
    p = commands.add_parser("reshard", help="rewrite a checkpoint for another TP/PP size, offline, tensor by tensor")
    p.add_argument("directory", metavar="DIR", type=_path)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, required=True)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, help="default: as saved")
    p.add_argument("--output", "-o", required=True, type=_path)
    p.add_argument("--max-file-size", type=int, default=5 * 1024**3, help="bytes per part (default 5 GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --output")
    p.set_defaults(run=reshard)
    p = commands.add_parser(
        "convert", help="write a Hugging Face model as per-rank files for a TP/PP size, without an engine"
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        type=_path,
        help="a Hugging Face model (safetensors): a folder, a Hub repo id, or an s3://, gs://, az:// prefix",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, required=True)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--output", "-o", required=True, type=_path)
    p.add_argument("--dtype", default="auto", help="the dtype vLLM would load the model in (default: auto)")
    p.add_argument("--quantization", default=None, help="the quantization the source already has, as vLLM names it")
    p.add_argument("--max-file-size", type=int, default=5 * 1024**3, help="bytes per part (default 5 GiB)")
    p.add_argument("--file-pattern", default=None, help="part names (default: vLLM's)")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --output")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--runner", default="auto", help="as vLLM's --runner: 'pooling' for an embedding model")
    p.add_argument("--convert", default="auto", help="as vLLM's --convert: 'embed' for a causal LM served to embed")
    p.add_argument("--revision", default=None, help="of a Hub repo id: a branch, tag or commit (default: main)")
    p.set_defaults(run=convert)
    p = commands.add_parser("keygen", help="write a key pair to sign checkpoints with (Ed25519, PEM)")
    p.add_argument("--output", "-o", required=True, type=_path, help="the folder: private.pem (0600), public.pem")
    p.set_defaults(run=keygen)
    p = commands.add_parser(
        "sign", help="sign a checkpoint's manifest, so that its start-up artifacts run where the key is trusted"
    )
    p.add_argument("directory", metavar="DIR", type=_path, help="a folder or an s3://, gs://, az:// prefix")
    p.add_argument("--key", required=True, type=_path, help="the private key (PEM), as vllm-sharded keygen writes it")
    p.set_defaults(run=sign)
    commands.add_parser(
        "save",
        help="load a model in vLLM and save it sharded (same flags as examples/save_sharded_state.py)",
        add_help=False,
    )
    return parser


# The signal that stopped the command.
_stopped_by = signal.SIGINT


def _stop_on_signals() -> None:
    """Let ``SIGTERM`` and ``SIGHUP`` stop an engine-free command as Ctrl-C does, by raising KeyboardInterrupt.

    Their default action ends the process with no ``finally`` run, leaving a save's lock and staged
    parts behind; as an interrupt, the save takes back what it wrote before its publish.
    """

    def stop(signum: int, frame: object) -> None:
        global _stopped_by
        _stopped_by = signal.Signals(signum)
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:  # (one ignored by whoever started us, nohup's, stays so)
            signal.signal(signum, stop)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["save"]:
            from ..engine.save_cli import main as save_main

            return save_main(argv[1:])
        args = make_parser().parse_args(argv)
        if getattr(args, "directory", None) is not None:  # the checkpoint a command works on, resolved once
            from ..storage.location import open_store

            args.store = open_store(args.directory)
        return args.run(args)
    except _ReaderGone:
        # No error line; drop what is buffered for the closed pipe, and end by SIGPIPE (run).
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ShardedStateError, OSError) as e:
        # (Line breaks kept: a library's message may have several lines; a name in it shows as it is.)
        notes = [str(n) for n in getattr(e, "__notes__", [])]
        print(*(shown(t, keep="\n") for t in [f"vllm-sharded: error: {e}", *notes]), sep="\n", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if argv[:1] == ["save"]:
            raise  # (an engine's save: vLLM's workers stop in its own teardown, as before)
        # One line, not a traceback (after SIGHUP the terminal may be gone).
        with contextlib.suppress(OSError):
            print(f"vllm-sharded: interrupted by {_stopped_by.name}. {_after_interrupt(e, argv)}", file=sys.stderr)
        return 128 + _stopped_by


def _after_interrupt(interrupt: KeyboardInterrupt, argv: Sequence[str] = ()) -> str:
    """What an interrupted command left, and what to do."""
    if argv[:1] in (["verify"], ["inspect"]):
        return f"{argv[0]} only reads the checkpoint, which is as it was; run it again."
    if not isinstance(interrupt, InterruptedAfterPublish):
        return (
            "An interrupted reshard or convert leaves its output as it was, or complete if it had published; "
            "run the command again."
        )
    from ..checkpoint.carry import stale_left

    store = interrupt.store
    then = "the next save into it with --overwrite removes them"
    left = "Its save lock and any parts it replaced remain (our loader ignores them)"
    try:
        if store.save_is_running() is None:  # (a store that cannot tell a stopped save's lock from a running one's)
            then = f"delete {store.file_path(LOCK_NAME)}, then {then}"
        manifest = store.read_manifest()
        stale = [] if manifest is None else stale_left(store, manifest)
    except Exception:  # (what is left is said as far as it is known; the interrupt stays the news)
        stale = []
    if stale:
        left += f", and so do files of the checkpoint it replaced, which a server would read ({', '.join(stale)})"
    return (
        f"The new checkpoint in {interrupt.where} was published and is complete; nothing needs to run again. "
        f"{left}: {then}."
    )


def run() -> None:
    """The ``vllm-sharded`` command: :func:`main`, its code the process's exit status.

    A command that ran no engine runs its exit handlers, flushes, and skips Python's slow module
    teardown. ``save`` exits as usual: its engine's workers stop in that teardown.
    """
    argv = sys.argv[1:]
    if argv[:1] != ["save"]:  # (an engine's save keeps vLLM's own handling of SIGTERM)
        _stop_on_signals()
    code = main(argv)
    if argv[:1] == ["save"]:
        sys.exit(code)
    atexit._run_exitfuncs()  # what sys.exit runs before the teardown (atexit has no public name for it)
    with contextlib.suppress(OSError):  # (a terminal gone with SIGHUP)
        sys.stdout.flush()
        sys.stderr.flush()
    for stopped in (_stopped_by, signal.SIGPIPE):
        if code == 128 + stopped:
            # Die by the signal, so that a shell's loop stops too.
            signal.signal(stopped, signal.SIG_DFL)
            os.kill(os.getpid(), stopped)
    os._exit(code)


if __name__ == "__main__":
    run()
