"""Property tests: any input to the manifest and header parsers either parses or raises
our error type, never another exception."""

import json
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.manifests import sample_manifest
from vllm_sharded_loader.format import Manifest, ShardedStateError
from vllm_sharded_loader.format.safetensors import parse_header

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)


def parses_or_refuses(text) -> None:
    try:
        manifest = Manifest.from_json(text)
    except ShardedStateError:
        return
    assert isinstance(manifest, Manifest)
    assert Manifest.from_json(manifest.to_json()) == manifest


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300))
def test_manifest_from_arbitrary_bytes(data):
    parses_or_refuses(data)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_manifest_from_arbitrary_json(value):
    parses_or_refuses(json.dumps(value))


def paths(value, prefix=()):
    """Every (path, value) inside a JSON document."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, (*prefix, i))


VALID = json.loads(sample_manifest(tp=2, pp=2).to_json())
VALID_PATHS = [p for p, _ in paths(VALID) if p]


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(VALID_PATHS), json_values, st.booleans()), min_size=1, max_size=3))
def test_manifest_with_mutated_fields(edits):
    data = json.loads(json.dumps(VALID))
    for path, value, delete in edits:
        node = data
        try:
            for key in path[:-1]:
                node = node[key]
            if delete:
                del node[path[-1]]
            else:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced this path
    parses_or_refuses(json.dumps(data))


def parse(raw: bytes, file_size: int | None = None):
    size = len(raw) if file_size is None else file_size
    try:
        return parse_header(raw[:8], raw[8 : 8 + int.from_bytes(raw[:8].ljust(8, b"\0"), "little")], "f", size)
    except ShardedStateError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 2**40))
def test_header_from_arbitrary_bytes(raw, file_size):
    parse(raw, file_size)


header_entries = st.dictionaries(
    st.text(max_size=8),
    st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "BF16", "U8", "BOOL", "Q7"]) | json_values,
            "shape": st.lists(st.integers(-2, 2**40), max_size=3) | json_values,
            "data_offsets": st.lists(st.integers(-2, 2**41), min_size=2, max_size=2) | json_values,
        }
    )
    | json_values,
    max_size=4,
)


@settings(max_examples=400, deadline=None)
@given(header_entries, st.binary(max_size=64))
def test_header_from_arbitrary_json(entries, data):
    text = json.dumps(entries).encode()
    header = parse(struct.pack("<Q", len(text)) + text + data)
    if header is not None:  # what parses is consistent: tensors tile the data exactly
        assert sum(e.end - e.begin for e in header.tensors.values()) == header.file_size - header.data_start
