"""On-disk format: file names, patterns, the manifest and the source identity."""

import json

import pytest

from tests.support.manifests import sample_manifest
from vllm_sharded_loader.format import (
    PP_AND_TP_PATTERN,
    TP_ONLY_PATTERN,
    Manifest,
    config_differences,
    config_sha256,
    default_pattern,
    parse_file_name,
    render_file_name,
    validate_pattern,
)
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption
from vllm_sharded_loader.format.manifest import MAX_CARRIED_FILES, CarriedFile


def test_names_are_vllms():
    assert render_file_name(TP_ONLY_PATTERN, tp_rank=3, pp_rank=0, part=2) == "model-rank-3-part-2.safetensors"
    assert render_file_name(PP_AND_TP_PATTERN, tp_rank=1, pp_rank=2, part=0) == "model-pp-2-tp-1-part-0.safetensors"
    assert default_pattern(1) == TP_ONLY_PATTERN
    assert default_pattern(4) == PP_AND_TP_PATTERN


@pytest.mark.parametrize("pattern", [TP_ONLY_PATTERN, PP_AND_TP_PATTERN, "w-{tp_rank}-{rank}-{pp_rank}-{part}.st"])
def test_parse_inverts_render(pattern):
    for tp in range(3):
        for pp in range(2):
            for part in (0, 11):
                name = render_file_name(pattern, tp_rank=tp, pp_rank=pp, part=part)
                fields = parse_file_name(pattern, name)
                assert fields["part"] == part
                assert fields["tp_rank"] == tp
                assert fields.get("pp_rank", pp) == pp


def test_parse_rejects_other_names():
    assert parse_file_name(TP_ONLY_PATTERN, "model-rank-1-part-0.safetensors.tmp") is None
    assert parse_file_name(TP_ONLY_PATTERN, "model.safetensors") is None
    # {rank} and {tp_rank} are one value: a name disagreeing with itself is not ours.
    assert parse_file_name("w-{tp_rank}-{rank}-{part}", "w-1-2-0") is None


@pytest.mark.parametrize(
    ("pattern", "tp", "pp", "message"),
    [
        ("model-{part}.safetensors", 2, 1, "tensor parallel rank"),
        ("model-rank-{rank}-part-{part}.safetensors", 1, 2, "pipeline parallel rank"),
        ("model-pp-{pp_rank}-part-{part}.safetensors", 2, 2, "tensor parallel rank"),
        ("model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors", 2, 1, "requires pipeline parallelism"),
        ("model-{rank}-{foo}-{part}.safetensors", 1, 1, "unsupported placeholder"),
        ("model-{rank}.safetensors", 2, 1, "no {part} field"),
        ("../model-{rank}-{part}.safetensors", 2, 1, "plain file"),
        ("sub/model-{rank}-{part}.safetensors", 2, 1, "plain file"),
        ("model-{rank-{part}", 2, 1, "not a valid format string"),
        ("model-{rank}{part}.safetensors", 2, 1, "side by side"),
        ("model-{pp_rank}{tp_rank}-{part}.safetensors", 2, 2, "side by side"),
        ("model-{rank}0{part}.safetensors", 2, 1, "side by side"),
    ],
)
def test_bad_patterns_are_refused(pattern, tp, pp, message):
    with pytest.raises(InvalidOption, match=message):
        validate_pattern(pattern, tp, pp)


@pytest.mark.parametrize(
    ("pattern", "replicas", "message"),
    [
        (TP_ONLY_PATTERN, 2, "does not embed the data-parallel rank"),
        (default_pattern(1, 2), 1, "only one replica writes files"),
    ],
)
def test_the_data_parallel_rank_is_in_names_exactly_when_replicas_write(pattern, replicas, message):
    with pytest.raises(InvalidOption, match=message):
        validate_pattern(pattern, 2, 1, replicas)


@pytest.mark.parametrize("pp", [1, 2])
def test_replica_names_carry_every_rank(pp):
    pattern = default_pattern(pp, replicas=2)
    validate_pattern(pattern, 2, pp, 2)
    names = set()
    for dp in range(2):
        for tp in range(2):
            name = render_file_name(pattern, tp_rank=tp, pp_rank=pp - 1, dp_rank=dp, part=3)
            fields = parse_file_name(pattern, name)
            assert (fields["dp_rank"], fields["tp_rank"], fields["part"]) == (dp, tp, 3)
            names.add(name)
    assert len(names) == 4
    assert render_file_name(pattern, tp_rank=1, pp_rank=0, dp_rank=1, part=0).startswith(
        "model-dp-1-rank-1" if pp == 1 else "model-pp-0-dp-1-tp-1"
    )


def test_good_patterns_pass():
    validate_pattern(TP_ONLY_PATTERN, 8, 1)
    validate_pattern(PP_AND_TP_PATTERN, 8, 4)
    validate_pattern("model-{part}.safetensors", 1, 1)
    validate_pattern("m-{{literal}}-{rank}-{part}.safetensors", 2, 1)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_manifest_round_trip(tp, pp):
    manifest = sample_manifest(tp, pp)
    again = Manifest.from_json(manifest.to_json())
    assert again == manifest
    assert again.rank(tp - 1, pp - 1).files[0].size == 1234
    assert again.nbytes == 1234 * tp * pp


def mutate(edit) -> str:
    data = json.loads(sample_manifest().to_json())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="other"), "not a vllm-sharded-loader manifest"),
        (lambda d: d.update(tp_size=0), "'tp_size' must be an integer >= 1"),
        (lambda d: d.update(tp_size="2"), "'tp_size' must be an integer"),
        (lambda d: d["ranks"].pop(), "missing"),
        (lambda d: d["ranks"].append(d["ranks"][0]), "listed twice"),
        (lambda d: d["ranks"][0]["files"][0].update(name="../../etc/passwd"), "not a plain file name"),
        (lambda d: d["ranks"][0]["files"][0].update(name="/etc/passwd"), "not a plain file name"),
        (lambda d: d["ranks"][0]["files"][0].update(size=-1), "'size' must be an integer >= 0"),
        (lambda d: d["ranks"][0]["tensors"]["w"].update(shape=[4, -8]), "expected a list of sizes"),
        (lambda d: d["ranks"][0]["tensors"]["w"].update(file="elsewhere.safetensors"), "does not list"),
        (lambda d: d["ranks"][1]["files"][0].update(name=d["ranks"][0]["files"][0]["name"]), "listed by two ranks"),
        (lambda d: d.update(pattern="model-{part}.safetensors"), "tensor parallel rank"),
        (lambda d: d.update(source=[]), "source must be an object"),
    ],
)
def test_bad_manifests_are_refused(edit, message):
    with pytest.raises(CheckpointCorrupt, match=message):
        Manifest.from_json(mutate(edit))


def test_a_manifest_of_a_later_format_is_refused_as_a_mismatch():
    with pytest.raises(CheckpointMismatch, match="format_version 99 is not supported"):
        Manifest.from_json(mutate(lambda d: d.update(format_version=99)))


CARRIED = {"size": 12, "sha256": "ab" * 32}


def test_carried_files_round_trip_and_are_optional():
    manifest = Manifest.from_json(mutate(lambda d: d.update(carried_files={"tok/vocab.txt": CARRIED})))
    assert manifest.carried_files == {"tok/vocab.txt": CarriedFile(12, "ab" * 32)}
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert Manifest.from_json(mutate(lambda d: d.update(carried_files={}))).carried_files == {}
    assert Manifest.from_json(mutate(lambda d: None)).carried_files is None  # an older manifest: not recorded


@pytest.mark.parametrize(
    ("carried", "message"),
    [
        ([], "carried_files must be an object"),
        ({"config.json": CARRIED | {"size": -1}}, r"carried file 'config.json': 'size' must be a byte count"),
        ({"config.json": CARRIED | {"size": "12"}}, "'size' must be a byte count"),
        ({"config.json": CARRIED | {"sha256": "xyz"}}, r"'sha256' must be 64 hexadecimal digits, found 'xyz'"),
        ({"config.json": CARRIED | {"sha256": "AB" * 32}}, "'sha256' must be 64 hexadecimal digits"),
        ({"config.json": {"size": 12}}, "'sha256' must be a string"),
        ({"/etc/passwd": CARRIED}, "carried file name '/etc/passwd' is not a relative path inside"),
        ({"../config.json": CARRIED}, "carried file name '../config.json' is not a relative path"),
        ({"tok/../../x": CARRIED}, "not a relative path"),
        ({"tok//x": CARRIED}, "not a relative path"),
        ({"": CARRIED}, "not a relative path"),
        ({"config.json": 12}, "carried file 'config.json' must be an object"),
    ],
)
def test_hostile_carried_files_are_refused(carried, message):
    with pytest.raises(CheckpointCorrupt, match=message):
        Manifest.from_json(mutate(lambda d: d.update(carried_files=carried)))


def test_stale_files_round_trip_and_are_optional():
    manifest = Manifest.from_json(mutate(lambda d: d.update(stale_files=["tok/old.txt", "chat_template.jinja"])))
    assert manifest.stale_files == ("tok/old.txt", "chat_template.jinja")
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert Manifest.from_json(mutate(lambda d: None)).stale_files == ()  # none, or a manifest from before the record
    assert "stale_files" not in Manifest.from_json(mutate(lambda d: None)).to_json()


@pytest.mark.parametrize(
    ("stale", "message"),
    [
        ({"x": 1}, f"'stale_files' must be a list of at most {MAX_CARRIED_FILES} file names"),
        (["config.json", 3], "'stale_files' must be a list of at most"),
        (["../config.json"], "carried file name '../config.json' is not a relative path"),
        (["/etc/passwd"], "not a relative path"),
        ([f"f{i}" for i in range(MAX_CARRIED_FILES + 1)], "'stale_files' must be a list of at most"),
    ],
)
def test_hostile_stale_files_are_refused(stale, message):
    with pytest.raises(CheckpointCorrupt, match=message):
        Manifest.from_json(mutate(lambda d: d.update(stale_files=stale)))


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '"x"', b"\xff\xfe"])
def test_unparsable_manifests_are_refused(text):
    with pytest.raises(CheckpointCorrupt):
        Manifest.from_json(text)


def test_config_hash_ignores_paths_versions_and_dtype():
    base = {"hidden_size": 64, "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0}
    noisy = dict(base, _name_or_path="/somewhere", transformers_version="9.9", torch_dtype="float16", dtype="x")
    assert config_sha256(base) == config_sha256(noisy)
    assert config_sha256(base) != config_sha256(dict(base, hidden_size=128))
    assert config_differences(base, dict(base, hidden_size=128)) == ["hidden_size: 64 -> 128"]
