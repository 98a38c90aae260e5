"""Property: an edited manifest is refused or loads exactly what the unedited one loads.

A real checkpoint of a small Llama-like model (two layers, every kind of geometry) is
saved once at TP=2, engine-free. Each example copies it, applies one to three random
edits to ``sharded_state.json`` (any field of any rank, file, tensor, checksum, geometry
or tied group, or a top-level field; values near the real ones and extreme ones; keys
dropped or renamed, ranks duplicated, offsets swapped), and runs every path:

- ``load_rank`` at the saved topology (TP=2, both ranks) with ``verify="size"`` and
  ``verify="checksum"``;
- ``load_rank`` resharded to TP=1 with ``verify="size"`` and ``verify="checksum"``;
- offline ``reshard_checkpoint(dir, out, 1)`` then a TP=1 load of ``out``;
- ``verify_checkpoint(dir)``.

Each load path must either raise :class:`ShardedStateError` or fill the model's tensors
byte for byte as the same path does on the unedited checkpoint; any other exception, a
hang or wrong bytes is a failure. ``verify_checkpoint`` must return a list (or raise
:class:`ShardedStateError`), and when it reports no problem every load path must give the
unedited bytes: only a refusal that depends on the served model (its source identity) or
on resharding (geometry, tied names, which verify does not claim to check) may remain.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import json
import os
import resource
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_sharded_loader.checkpoint.verify as verify_module
from tests.support.checkpoints import save_model, source_of, stage_state
from tests.support.reference import Model, llama_like
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest, verify_checkpoint
from vllm_sharded_loader.format import MANIFEST_NAME, ShardedStateError
from vllm_sharded_loader.format.geometry import KINDS
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.reader import ReadOptions
from vllm_sharded_loader.tools.offline import reshard_checkpoint

MODEL: Model = llama_like(num_layers=2, vocab=100, kv_heads=2)
SAVED_TP = 2
# What the served model's layers say (the engine's loader passes the same).
GEOMETRY = {name: t.geometry for name, t in MODEL.tensors.items()}
# Seconds one path may take before it counts as hung (a sound one takes milliseconds).
PATH_TIMEOUT = 20
# Address space an example may add (a path allocating more has planned an absurd read).
MEMORY_HEADROOM = 4 * 1024**3

JsonPath = tuple[str | int, ...]
Loaded = dict[str, bytes]


# ------------------------------------------------------------------------- paths


def fresh_targets(tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """The model's tensors of one rank, filled with a value no saved tensor is made of."""
    return {name: torch.full_like(x, -7) for name, x in stage_state(MODEL, tp_size, 1, tp_rank, 0).items()}


def as_bytes(targets: dict[str, torch.Tensor]) -> Loaded:
    return {name: t.reshape(-1).view(torch.uint8).numpy().tobytes() for name, t in targets.items()}


def load(directory: str, tp_size: int, tp_rank: int, verify: str) -> Loaded:
    targets = fresh_targets(tp_size, tp_rank)
    load_rank(
        LoadRequest(
            open_store(directory),
            read_manifest(directory),
            verify=verify,
            serving=source_of(MODEL),
            geometry=GEOMETRY,
            tied=MODEL.tied_groups,
        ),
        targets,
        RankInfo(tp_rank, tp_size),
        options=ReadOptions(threads=2),
    )
    return as_bytes(targets)


def offline(directory: str, scratch: str) -> Loaded:
    out = os.path.join(scratch, "resharded")
    reshard_checkpoint(open_store(directory), out, 1)
    return load(out, 1, 0, "checksum")


def loader(tp_size: int, tp_rank: int, verify: str) -> Callable[[str, str], Loaded]:
    return lambda directory, scratch: load(directory, tp_size, tp_rank, verify)


LOAD_PATHS: dict[str, Callable[[str, str], Loaded]] = {
    **{f"TP=2 rank {r} verify={v}": loader(SAVED_TP, r, v) for r in range(SAVED_TP) for v in ("size", "checksum")},
    **{f"TP=1 resharded verify={v}": loader(1, 0, v) for v in ("size", "checksum")},
    "offline reshard to TP=1, then TP=1 load": offline,
}


class Hung(Exception):
    """A path ran past PATH_TIMEOUT."""


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Turn a hang into :class:`Hung` and an absurd allocation into an error, not a dead machine."""

    def alarm(signum: int, frame: Any) -> None:
        raise Hung(f"no result after {PATH_TIMEOUT} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(PATH_TIMEOUT)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    cap = used + MEMORY_HEADROOM
    if soft == resource.RLIM_INFINITY or soft > cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@dataclass(frozen=True)
class Outcome:
    """What one path did: the bytes it loaded, or the exception it raised."""

    loaded: Loaded | None = None
    error: BaseException | None = None

    def describe(self) -> str:
        if self.error is None:
            return "loaded"
        return f"{type(self.error).__name__}: {str(self.error)[:300]}"


def run_path(path: Callable[[str, str], Loaded], directory: str, scratch: str) -> Outcome:
    try:
        with guarded():
            return Outcome(loaded=path(directory, scratch))
    except Exception as e:  # every exception is an outcome, judged by the property
        return Outcome(error=e)


def run_verify(directory: str) -> Outcome:
    try:
        with guarded():
            problems = verify_checkpoint(open_store(directory))
    except Exception as e:
        return Outcome(error=e)
    return Outcome(loaded={f"problem {i}": p.encode() for i, p in enumerate(problems)})


# ------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class Base:
    """The saved checkpoint, its manifest as JSON data, and what each path loads from it."""

    root: str
    directory: str
    manifest: dict[str, Any]
    loaded: dict[str, Loaded]


@functools.cache
def base() -> Base:
    root = tempfile.mkdtemp(prefix="manifest-edits-")
    atexit.register(shutil.rmtree, root, True)
    directory = os.path.join(root, "saved")
    save_model(directory, MODEL, SAVED_TP, 1)
    with open(os.path.join(directory, MANIFEST_NAME)) as f:
        manifest = json.load(f)
    scratch = tempfile.mkdtemp(dir=root)
    loaded = {}
    for name, path in LOAD_PATHS.items():
        outcome = run_path(path, directory, scratch)
        assert outcome.loaded is not None, f"{name} fails on the unedited checkpoint: {outcome.describe()}"
        loaded[name] = outcome.loaded
    shutil.rmtree(scratch)
    return Base(root, directory, manifest, loaded)


@contextlib.contextmanager
def edited_copy(edits: list[Edit]) -> Iterator[tuple[str, str]]:
    """A copy of the saved checkpoint with ``edits`` applied to its manifest, and a scratch folder."""
    work = tempfile.mkdtemp(dir=base().root)
    try:
        directory = os.path.join(work, "ckpt")
        shutil.copytree(base().directory, directory)
        data = copy.deepcopy(base().manifest)
        for edit in edits:
            edit.apply(data)
        with open(os.path.join(directory, MANIFEST_NAME), "w") as f:
            json.dump(data, f, indent=1)
        scratch = os.path.join(work, "scratch")
        os.mkdir(scratch)
        yield directory, scratch
    finally:
        shutil.rmtree(work, ignore_errors=True)


def failures(edits: list[Edit]) -> list[str]:
    """Every violation of the property by one edited checkpoint, one line each (empty: it holds)."""
    found = []
    with edited_copy(edits) as (directory, scratch):
        outcomes = {name: run_path(path, directory, scratch) for name, path in LOAD_PATHS.items()}
        verdict = run_verify(directory)
    for name, outcome in outcomes.items():
        if outcome.error is not None and not isinstance(outcome.error, ShardedStateError):
            found.append(f"{name}: raised {outcome.describe()}")
        elif outcome.loaded is not None and outcome.loaded != base().loaded[name]:
            wrong = sorted(n for n, b in outcome.loaded.items() if b != base().loaded[name][n])
            found.append(f"{name}: loaded other bytes than the unedited checkpoint, silently, into {wrong[:6]}")
    if verdict.error is not None and not isinstance(verdict.error, ShardedStateError):
        found.append(f"verify_checkpoint: raised {verdict.describe()}")
    elif verdict.loaded == {}:
        for name, outcome in outcomes.items():
            resharding = not name.startswith("TP=2")
            # Refusals that compare with the served model (its identity, its layers' geometry).
            served_model = isinstance(outcome.error, ShardedStateError) and any(
                what in str(outcome.error) for what in ("but the engine serves", "is not the served model's")
            )
            if outcome.error is not None and not resharding and not served_model:
                found.append(f"verify_checkpoint reports no problem, but {name} refuses: {outcome.describe()}")
            elif outcome.loaded is not None and outcome.loaded != base().loaded[name]:
                found.append(f"verify_checkpoint reports no problem, but {name} loads other bytes")
    return found


# ------------------------------------------------------------------------ edits


def resolve(data: Any, path: JsonPath) -> tuple[Any, str | int]:
    """The container holding ``path``'s last key, and that key; KeyError/IndexError/TypeError if absent."""
    for key in path[:-1]:
        data = data[key]
    if not isinstance(data, (dict, list)) or (isinstance(data, list) and not isinstance(path[-1], int)):
        raise TypeError(path)
    return data, path[-1]


@dataclass(frozen=True)
class Set:
    """Set (or add) the value at ``path``."""

    path: JsonPath
    value: Any

    def apply(self, data: Any) -> None:
        with contextlib.suppress(KeyError, IndexError, TypeError):
            parent, key = resolve(data, self.path)
            parent[key] = copy.deepcopy(self.value)


@dataclass(frozen=True)
class Delete:
    """Drop the key or list item at ``path``."""

    path: JsonPath

    def apply(self, data: Any) -> None:
        with contextlib.suppress(KeyError, IndexError, TypeError):
            parent, key = resolve(data, self.path)
            del parent[key]


@dataclass(frozen=True)
class Duplicate:
    """Append a copy of the list item at ``path`` to its list (a rank, a file, a segment, a dimension)."""

    path: JsonPath

    def apply(self, data: Any) -> None:
        with contextlib.suppress(KeyError, IndexError, TypeError):
            parent, key = resolve(data, self.path)
            if isinstance(parent, list):
                parent.append(copy.deepcopy(parent[key]))


@dataclass(frozen=True)
class Swap:
    """Exchange the values at two paths (two tensors' offsets, files, shapes, geometries...)."""

    a: JsonPath
    b: JsonPath

    def apply(self, data: Any) -> None:
        with contextlib.suppress(KeyError, IndexError, TypeError):
            (pa, ka), (pb, kb) = resolve(data, self.a), resolve(data, self.b)
            pa[ka], pb[kb] = pb[kb], pa[ka]


@dataclass(frozen=True)
class Rename:
    """Rename tensor ``old`` to ``new`` in the mappings at ``paths`` (a rank's tensors, the geometry)."""

    paths: tuple[JsonPath, ...]
    old: str
    new: str

    def apply(self, data: Any) -> None:
        for path in self.paths:
            with contextlib.suppress(KeyError, IndexError, TypeError):
                parent, key = resolve(data, path)
                mapping = parent[key]
                if isinstance(mapping, dict) and self.old in mapping:
                    # Keep the order of the keys: the rename is the only change.
                    parent[key] = {(self.new if k == self.old else k): v for k, v in mapping.items()}


Edit = Set | Delete | Duplicate | Swap | Rename


def walk(value: Any, prefix: JsonPath = ()) -> Iterator[tuple[JsonPath, Any]]:
    """Every (path, value) below the root of a JSON document."""
    if prefix:
        yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from walk(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from walk(v, (*prefix, i))


def field_of(path: JsonPath) -> str:
    """The name of the field a path ends at (``shape`` for a dimension, ``blocks`` for a digest)."""
    named = [k for k in path if isinstance(k, str)]
    if len(path) >= 2 and path[-2] in ("tensors", "geometry"):
        return "<tensor>"
    return named[-1] if named else ""


EXTREME_INTS = [0, 1, -1, 2, 3, -(2**63), 2**31 - 1, 2**32, 10**9, 2**62, 2**63, 2**64, 10**30]
JUNK = [None, True, False, "7", 1.5, [], {}, [1], "", -0.0]
PATTERNS = [
    "model-rank-{rank}-part-{part}.safetensors",
    "model-rank-{rank:>999999999}-part-{part}.safetensors",
    "model-rank-{rank:03d}-part-{part}.safetensors",
    "model-rank-{rank!r}-part-{part}.safetensors",
    "model-rank-{rank[0]}-part-{part}.safetensors",
    "model-rank-{rank.real}-part-{part}.safetensors",
    "model-rank-{part:{rank}}-part-{part}.safetensors",
    "model-{tp_rank}-{part}.safetensors",
    "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors",
    "{rank}{part}",
    "model-rank-{rank}-part-{part}",
    "model-rank-{rank}.safetensors",
    "{{rank}}-{rank}-{part}",
    "model-rank-{rank}-part-{part}-{rank}.safetensors",
]
STRINGS = {
    "dtype": [
        "I32",
        "F32",
        "I16",
        "I64",
        "I8",
        "U8",
        "U32",
        "BF16",
        "F16",
        "BOOL",
        "F8_E4M3",
        "int32",
        "bfloat16",
        "x",
    ],
    "kind": [*KINDS, "column", "x"],
    "algorithm": ["blake3", "sha256", "BLAKE3", ""],
    "pattern": PATTERNS,
    "architecture": ["LlamaForCausalLM", "MistralForCausalLM", ""],
    "config_sha256": ["0" * 64, "x"],
    "name": ["model-rank-0-part-0.safetensors", "x.safetensors", "sharded_state.json", "q", "k", "v", "gate", "up"],
    "file": ["x.safetensors", "sharded_state.json", ""],
    "format": ["vllm-sharded-state", "x"],
    "layer_class": ["RowParallelLinear", "x"],
}


def pools(manifest: dict[str, Any]) -> dict[str, list[Any]]:
    """Every value the manifest holds under each field name: realistic replacements."""
    found: dict[str, list[Any]] = {}
    for path, value in walk(manifest):
        if isinstance(value, (dict, list)) and not (isinstance(value, list) and all(isinstance(v, int) for v in value)):
            continue
        values = found.setdefault(field_of(path), [])
        if value not in values:
            values.append(value)
    return found


def int_values(value: int) -> st.SearchStrategy[int]:
    near = st.integers(-4, 4).filter(bool).map(lambda d: value + d)
    scaled = st.sampled_from([value * 2, value // 2, -value, value + 4096, value - 4096])
    return st.one_of(near, scaled, st.sampled_from(EXTREME_INTS))


def dims(shape: list[int]) -> st.SearchStrategy[list[int]]:
    """A shape with one dimension changed, dropped or added."""
    options: list[st.SearchStrategy[list[int]]] = [
        st.sampled_from([[], [0], [1], [*shape, 1], [1, *shape], [*shape, 2], shape[::-1], [*shape, *shape]])
    ]
    if shape:
        index = st.integers(0, len(shape) - 1)
        options.append(index.map(lambda i: shape[:i] + shape[i + 1 :]))
        options.append(
            st.tuples(index, st.sampled_from([0, 1, 2, -1, 2**31, 2**62, 2**63, 10**12]) | st.integers(-3, 3)).map(
                lambda p: [d if i != p[0] else (d + p[1] if abs(p[1]) <= 3 else p[1]) for i, d in enumerate(shape)]
            )
        )
    return st.one_of(options)


def mutations(path: JsonPath, value: Any, pool: dict[str, list[Any]]) -> st.SearchStrategy[Edit]:
    """Edits of one node: another value of its kind, a value of another type, its removal."""
    name = field_of(path)
    realistic = [v for v in pool.get(name, []) if v != value]
    options: list[st.SearchStrategy[Any]] = [st.sampled_from(JUNK)]
    if realistic:
        options.append(st.sampled_from(realistic))
    if isinstance(value, bool):
        options.append(st.just(not value))
    elif isinstance(value, int):
        options.append(int_values(value))
    elif isinstance(value, str):
        options.append(st.sampled_from(STRINGS.get(name, ["x", value + "x"])))
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        options.append(dims(value))
    elif isinstance(value, list):
        options.append(st.sampled_from([value[:-1], value[1:], value[::-1], value + value[-1:]]))
    elif isinstance(value, dict):
        options.append(st.sampled_from([{k: v for k, v in value.items() if k != key} for key in value]))
    sets = st.one_of(options).map(lambda v: Set(path, v))
    edits: list[st.SearchStrategy[Edit]] = [sets, st.just(Delete(path))]
    if isinstance(path[-1], int):
        edits.append(st.just(Duplicate(path)))
    return st.one_of(edits)


def edit_strategy(manifest: dict[str, Any]) -> st.SearchStrategy[Edit]:
    """One edit of the manifest: of any node, or one of the edits that keep it plausible."""
    pool = pools(manifest)
    nodes = list(walk(manifest))
    by_field: dict[str, list[JsonPath]] = {}
    for path, _ in nodes:
        by_field.setdefault(field_of(path), []).append(path)
    ranks = manifest["ranks"]
    names = sorted({n for r in ranks for n in r["tensors"]})
    # Offsets of tensors in one file: swapping two of them keeps every offset plausible.
    same_file = [
        (("ranks", i, "tensors", a, "offset"), ("ranks", i, "tensors", b, "offset"))
        for i, r in enumerate(ranks)
        for a in r["tensors"]
        for b in r["tensors"]
        if a < b and r["tensors"][a]["file"] == r["tensors"][b]["file"]
    ]
    tensor_maps: list[JsonPath] = [("ranks", i, "tensors") for i in range(len(ranks))]
    # Rename a tensor in one rank, in the geometry, or everywhere.
    where = [(m,) for m in [*tensor_maps, ("geometry",)]] + [(*tensor_maps, ("geometry",))]
    new_names = st.sampled_from(names) | st.sampled_from(["x", "model.layers.9.mlp.down_proj.weight", ""])
    any_name = st.sampled_from(names) | st.just("model.layers.9.x")
    return st.one_of(
        st.sampled_from(nodes).flatmap(lambda node: mutations(node[0], node[1], pool)),
        st.sampled_from(same_file).map(lambda ab: Swap(*ab)),
        st.sampled_from(sorted(by_field))
        .flatmap(lambda f: st.tuples(st.sampled_from(by_field[f]), st.sampled_from(by_field[f])))
        .map(lambda ab: Swap(*ab)),
        st.builds(Rename, st.sampled_from(where), st.sampled_from(names), new_names),
        st.lists(st.lists(any_name, min_size=1, max_size=3), min_size=1, max_size=2).map(lambda g: Set(("tied",), g)),
        st.sampled_from([("ranks", i) for i in range(len(ranks))]).map(Duplicate),
    )


def edit_lists() -> st.SearchStrategy[list[Edit]]:
    return st.lists(edit_strategy(base().manifest), min_size=1, max_size=3)


# ------------------------------------------------------------------------ tests


@pytest.fixture(autouse=True, scope="module")
def small_verify_buffer() -> Iterator[None]:
    """verify_checkpoint streams each file through a fresh 64 MiB buffer: 1.5 s per example
    here for files of 4 KiB. The buffer's size changes nothing else."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(verify_module, "CHUNK_BYTES", 1024 * 1024)
        yield


def test_unedited_checkpoint_passes_every_path() -> None:
    """The harness itself: every path loads the reference shards, verify finds nothing."""
    for name, loaded in base().loaded.items():
        tp_size, rank = (SAVED_TP, int(name.split()[2])) if name.startswith("TP=2") else (1, 0)
        assert loaded == as_bytes(stage_state(MODEL, tp_size, 1, rank, 0)), name
    assert failures([]) == []
    assert failures([Set(("tp_size",), SAVED_TP)]) == []  # an edit that changes nothing


def first_two_same_size_in_one_file() -> tuple[str, str, int]:
    """Two tensors of rank 0 stored in one file with the same byte size (they are never equal)."""
    rank = base().manifest["ranks"][0]["tensors"]
    for a in rank:
        for b in rank:
            same = rank[a]["file"] == rank[b]["file"] and rank[a]["shape"] == rank[b]["shape"]
            if a < b and same and MODEL.tensors[a].data.tobytes() != MODEL.tensors[b].data.tobytes():
                return a, b, 0
    raise AssertionError("the model has no two same-size tensors in one file")


def swapped_offsets() -> list[Edit]:
    a, b, rank = first_two_same_size_in_one_file()
    return [Swap(("ranks", rank, "tensors", a, "offset"), ("ranks", rank, "tensors", b, "offset"))]


def all_files(key: str, value: Any) -> list[Edit]:
    return [
        Set(("ranks", r, "files", f, "checksum", key), value)
        for r, rank in enumerate(base().manifest["ranks"])
        for f in range(len(rank["files"]))
    ]


def segments_of(name: str) -> JsonPath:
    return ("geometry", name, "segments")


CASES: dict[str, Callable[[], list[Edit]]] = {
    "swapped offsets of two same-size tensors in one file": swapped_offsets,
    "tied group aliasing lm_head and the embedding (both saved)": lambda: [
        Set(("tied",), [["lm_head.weight", "model.embed_tokens.weight"]])
    ],
    "tied group aliasing two same-shape norms": lambda: [
        Set(("tied",), [["model.norm.weight", "model.layers.0.input_layernorm.weight"]])
    ],
    "huge checksum block_size": lambda: all_files("block_size", 2**62),
    "checksum block_size 1": lambda: all_files("block_size", 1),
    "pattern with a huge format width": lambda: [
        Set(("pattern",), "model-rank-{rank:>999999999}-part-{part}.safetensors")
    ],
    "tp_size 10**9": lambda: [Set(("tp_size",), 10**9)],
    "merged gate/up segments resized, same local shape": lambda: [
        Set((*segments_of("model.layers.0.mlp.gate_up_proj.weight"), 0, "size"), 40),
        Set((*segments_of("model.layers.0.mlp.gate_up_proj.weight"), 1, "size"), 56),
    ],
    "vocabulary segment shortened, same padding": lambda: [
        Set((*segments_of("model.embed_tokens.weight"), 0, "size"), 90)
    ],
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_edit_most_likely_to_break(case: str) -> None:
    assert failures(CASES[case]()) == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.deferred(edit_lists))
def test_edited_manifest_is_refused_or_loads_the_same_bytes(edits: list[Edit]) -> None:
    assert failures(edits) == []
