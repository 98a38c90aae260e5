"""Signed manifests and trusted keys, without an engine: keys, signatures, the save's signing step,
``vllm-sharded keygen``, ``sign``, ``inspect`` and ``verify``.

What a signature decides (whether a rank's start-up archives, code, may run) is tested where it is
used: ``test_startup_archive.py`` (the load's and ``prepare_node``'s check) and
``test_hostile_checkpoints.py`` (real engines serving hostile archives).
"""

import json
import os
import re
import stat
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.support.checkpoints import save_reshardable
from tests.support.signing import key_pair, signing, trusting
from tests.support.states import SOURCE
from tests.support.stores import bucket_on
from vllm_sharded_loader.checkpoint import RankInfo
from vllm_sharded_loader.checkpoint import startup_artifacts as sa
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.checkpoint.trust import (
    SIGNING_KEY_ENV,
    TRUSTED_KEYS_ENV,
    check_trust,
    keygen,
    load_signer,
)
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointLocked, InvalidKey
from vllm_sharded_loader.format.manifest import Manifest
from vllm_sharded_loader.format.names import LOCK_NAME, MANIFEST_NAME
from vllm_sharded_loader.format.signature import signed_message
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.tools.cli import main


@pytest.fixture
def env(monkeypatch):
    """Set the given variables for the test (no signing or trusted key unless given)."""
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    monkeypatch.delenv(TRUSTED_KEYS_ENV, raising=False)

    def set_env(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


def _parsed(manifest: Manifest) -> Manifest:
    return Manifest.from_json(manifest.to_json())


def _saved(directory, **options) -> Manifest:
    tensors = {"w": torch.arange(16, dtype=torch.float32).reshape(4, 4)}
    saving = SaveOptions(**options)
    return save_checkpoint(str(directory), {RankInfo(0, 1): tensors}, dtype="float32", source=SOURCE, options=saving)


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_over_a_key(tmp_path):
    private, public = keygen(str(tmp_path / "keys"))
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    before = Path(private).read_bytes()
    assert b"BEGIN PRIVATE KEY" in before and b"BEGIN PUBLIC KEY" in Path(public).read_bytes()
    with pytest.raises(InvalidKey, match=r"private\.pem exists"):
        keygen(str(tmp_path / "keys"))
    assert Path(private).read_bytes() == before


def test_a_signature_covers_the_whole_manifest_as_parsed_whatever_its_layout(tmp_path, env):
    manifest = _saved(tmp_path / "ckpt")
    signed = load_signer(key_pair()[0]).sign(manifest)
    env(**trusting())
    assert check_trust(_parsed(signed)).trusted
    # The same content in another layout (indentation, key order) verifies too.
    data = json.loads(signed.to_json())
    reordered = json.dumps(dict(reversed(list(data.items()))), indent=None)
    assert check_trust(Manifest.from_json(reordered)).trusted
    assert signed_message(json.loads(reordered)) == signed_message(json.loads(manifest.to_json()))
    # Any changed value does not (a part's size, a field the reader does not use).
    for change in (
        lambda d: d["ranks"][0]["files"][0].update(size=d["ranks"][0]["files"][0]["size"] + 1),
        lambda d: d["source"]["config"].update(hidden_size=1),
        lambda d: d.update(comment="added"),
        lambda d: d["signature"].update(value=d["signature"]["value"][::-1]),
        lambda d: d["signature"].update(value="not base64!"),
        lambda d: d["signature"].update(algorithm="ecdsa-sha256"),
    ):
        edited = json.loads(signed.to_json())
        change(edited)
        verdict = check_trust(Manifest.from_json(json.dumps(edited)))
        assert not verdict.trusted and "does not match the manifest" in verdict.reason, (edited, verdict)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"algorithm": "rsa", "key_id": "0" * 64, "value": ""}, "not one of"),
        ({"algorithm": "ed25519", "key_id": "xyz", "value": ""}, "64 hexadecimal digits"),
        ("signed", "must be an object"),
    ],
)
def test_a_malformed_signature_is_a_damaged_manifest(tmp_path, value, words):
    data = json.loads(_saved(tmp_path / "ckpt").to_json())
    data["signature"] = value
    with pytest.raises(CheckpointCorrupt, match=words):
        Manifest.from_json(json.dumps(data))


def test_trust_says_why_not_and_what_to_set(tmp_path, env):
    manifest = _saved(tmp_path / "ckpt")
    assert "is not signed" in check_trust(manifest).reason and "vllm-sharded sign" in check_trust(manifest).reason
    signed = _parsed(load_signer(key_pair()[0]).sign(manifest))
    verdict = check_trust(signed)
    assert not verdict.trusted and TRUSTED_KEYS_ENV in verdict.reason and verdict.signer in verdict.reason
    env(**trusting("stranger"))
    verdict = check_trust(signed)
    assert not verdict.trusted and "not among the keys trusted" in verdict.reason
    assert key_pair("stranger")[1] in verdict.reason
    # A trusted key file that gives no key is named, and trusts nothing (never a hang on a FIFO).
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key")
    env(**{TRUSTED_KEYS_ENV: os.pathsep.join([str(fifo), str(garbage), str(tmp_path / "missing.pem")])})
    verdict = check_trust(signed)
    assert not verdict.trusted
    for path in (fifo, garbage, tmp_path / "missing.pem"):
        assert str(path) in verdict.reason, verdict.reason
    # A file of several public keys trusts each of them; ECDSA keys sign and verify too.
    both = tmp_path / "both.pem"
    both.write_bytes(Path(key_pair("stranger")[1]).read_bytes() + Path(key_pair()[1]).read_bytes())
    env(**{TRUSTED_KEYS_ENV: str(both)})
    assert check_trust(signed).trusted
    ecdsa = tmp_path / "ecdsa.pem"
    key = ec.generate_private_key(ec.SECP256R1())
    ecdsa.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public = tmp_path / "ecdsa-public.pem"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    env(**{TRUSTED_KEYS_ENV: str(public)})
    assert check_trust(_parsed(load_signer(str(ecdsa)).sign(manifest))).trusted
    assert not check_trust(signed).trusted


PEM = serialization.Encoding.PEM


def _pem(key, encryption=None) -> bytes:
    encryption = encryption or serialization.NoEncryption()
    return key.private_bytes(PEM, serialization.PrivateFormat.PKCS8, encryption)


def _unusable_keys(tmp_path) -> dict[str, str]:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    keys = {
        "missing": (tmp_path / "missing.pem", None),
        "public": (tmp_path / "public.pem", Path(key_pair()[1]).read_bytes()),
        "encrypted": (
            tmp_path / "encrypted.pem",
            ec.generate_private_key(ec.SECP256R1()).private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(b"secret"),
            ),
        ),
        "rsa": (
            tmp_path / "rsa.pem",
            rsa_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        ),
    }
    for path, data in keys.values():
        if data is not None:
            path.write_bytes(data)
    fifo = tmp_path / "fifo.pem"
    os.mkfifo(fifo)
    return {name: str(path) for name, (path, _) in keys.items()} | {"fifo": str(fifo)}


def test_a_save_signs_its_manifest_and_an_unusable_key_refuses_it_before_anything_is_written(tmp_path, env):
    env(**signing(), **trusting())
    signed = _saved(tmp_path / "ckpt")
    published = Manifest.from_json((tmp_path / "ckpt" / MANIFEST_NAME).read_text())
    assert signed.signature == published.signature and check_trust(published).trusted
    for name, path in _unusable_keys(tmp_path).items():
        env(**{SIGNING_KEY_ENV: path})
        with pytest.raises(InvalidKey, match=re.escape(path)):
            _saved(tmp_path / name)
        assert not (tmp_path / name).exists(), name
        # Over a published checkpoint: it stays as it was, and unlocked.
        with pytest.raises(InvalidKey):
            _saved(tmp_path / "ckpt", overwrite=True)
        assert Manifest.from_json((tmp_path / "ckpt" / MANIFEST_NAME).read_text()) == published
        assert not (tmp_path / "ckpt" / LOCK_NAME).exists()


def test_sign_checks_each_archive_then_signs_under_the_save_lock(tmp_path, env):
    from tests.test_startup_archive import save_with_artifacts

    ckpt = tmp_path / "ckpt"
    manifest = save_with_artifacts(str(ckpt), 2, {0: b"rank 0", 1: b"rank 1"})
    assert manifest.signature is None
    files = sorted(p.name for p in ckpt.iterdir())
    signed = sa.sign_checkpoint(open_store(str(ckpt)), load_signer(key_pair()[0]))
    env(**trusting())
    assert check_trust(Manifest.from_json((ckpt / MANIFEST_NAME).read_text())).trusted
    assert signed.signature is not None and sorted(p.name for p in ckpt.iterdir()) == files
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(ckpt)), notes=notes) == []
    assert any("start-up artifacts (2 archives): used by a server with these trusted keys" in n for n in notes), notes
    # A damaged archive is not signed for: the manifest stays as it was.
    archive = ckpt / manifest.rank(1, 0).startup.file
    archive.write_bytes(b"rank 9")
    before = (ckpt / MANIFEST_NAME).read_bytes()
    with pytest.raises(CheckpointCorrupt):
        sa.sign_checkpoint(open_store(str(ckpt)), load_signer(key_pair("stranger")[0]))
    assert (ckpt / MANIFEST_NAME).read_bytes() == before and not (ckpt / LOCK_NAME).exists()
    # A running save holds the checkpoint: refused, nothing changed.
    from vllm_sharded_loader.storage.lock import acquire_save_lock, release_save_lock

    archive.write_bytes(b"rank 1")
    held = acquire_save_lock(str(ckpt), "othersave0000000", overwrite=True)
    try:
        with pytest.raises(CheckpointLocked):
            sa.sign_checkpoint(open_store(str(ckpt)), load_signer(key_pair("stranger")[0]))
        assert (ckpt / MANIFEST_NAME).read_bytes() == before
    finally:
        release_save_lock(held)


def test_the_commands_keygen_sign_inspect_and_verify(tmp_path, env, capsys):
    keys = tmp_path / "keys"
    assert main(["keygen", "-o", str(keys)]) == 0
    out = capsys.readouterr().out
    assert str(keys / "private.pem") in out and f"{TRUSTED_KEYS_ENV}={keys / 'public.pem'}" in out
    assert main(["keygen", "-o", str(keys)]) == 2 and "exists" in capsys.readouterr().err

    ckpt = tmp_path / "ckpt"
    save_reshardable(ckpt)
    assert main(["inspect", str(ckpt)]) == 0
    assert "signature     not used here: the checkpoint is not signed" in capsys.readouterr().out
    assert main(["sign", str(ckpt), "--key", str(keys / "private.pem")]) == 0
    out = capsys.readouterr().out
    assert "Signed" in out and "not used" in out and TRUSTED_KEYS_ENV in out
    env(**{TRUSTED_KEYS_ENV: str(keys / "public.pem")})
    assert main(["inspect", str(ckpt)]) == 0
    assert "signature     used here: signed by key" in capsys.readouterr().out
    assert main(["inspect", "--json", str(ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["trust"]["trusted"] and info["signature"]["algorithm"] == "ed25519"
    assert main(["sign", str(ckpt), "--key", str(keys / "public.pem")]) == 2
    assert "not an unencrypted PEM private key" in capsys.readouterr().err
    assert main(["sign", str(tmp_path / "nothing"), "--key", str(keys / "private.pem")]) == 2
    assert "no sharded checkpoint to sign" in capsys.readouterr().err and not (tmp_path / "nothing").exists()
    assert main(["verify", str(ckpt)]) == 0


@pytest.fixture(scope="module")
def bucket(seaweed):
    with bucket_on(seaweed, "signed"):
        yield "s3://signed"


def test_sign_a_checkpoint_in_a_bucket(bucket, env):
    from tests.test_startup_archive import save_with_artifacts

    url = f"{bucket}/ckpt"
    save_with_artifacts(url, 2, {0: b"rank 0", 1: b"rank 1"})
    store = open_store(url)
    names = sorted(store.list_names())
    sa.sign_checkpoint(open_store(url), load_signer(key_pair()[0]))
    env(**trusting())
    assert check_trust(store.read_manifest()).trusted
    assert sorted(store.list_names()) == names and not store.is_locked()
