"""Who may put code into a serving process: signed manifests and the keys an operator trusts.

Start-up archives are code, and whoever writes a checkpoint writes its manifest too: an archive is
used only where a key in ``SHARDED_STATE_TRUSTED_KEYS=PATH[:PATH...]`` verifies the manifest's
signature. Saves sign with ``SHARDED_STATE_SIGNING_KEY``. Ed25519 and ECDSA keys, PEM.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass, replace

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from ..format.errors import InvalidKey
from ..format.manifest import Manifest
from ..format.signature import Signature, signed_message

SIGNING_KEY_ENV = "SHARDED_STATE_SIGNING_KEY"
TRUSTED_KEYS_ENV = "SHARDED_STATE_TRUSTED_KEYS"
MAX_KEY_FILE_BYTES = 1 << 20
PEM_PUBLIC_KEY = b"-----BEGIN PUBLIC KEY-----"
PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey


def key_id(key: PublicKey) -> str:
    """A public key's id: the SHA-256 of its DER encoding (SubjectPublicKeyInfo), hexadecimal."""
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _read_key_file(path: str, what: str) -> bytes:
    """The bytes of a key file: a regular file (never a FIFO), of a key's size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidKey(f"{path}: cannot open the {what} ({e.strerror}); give the path of a PEM key file.") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE_BYTES:
            raise InvalidKey(
                f"{path}: not a key file (a {'large file' if stat.S_ISREG(st.st_mode) else 'special file'}), where "
                f"the {what} (PEM) was expected; give the path of a key file."
            )
        return os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Signer:
    """A private key that signs manifests, and the file it came from."""

    path: str
    key: PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.key.public_key())

    def sign(self, manifest: Manifest) -> Manifest:
        """``manifest`` with a signature of its content (any earlier signature replaced)."""
        message = signed_message(json.loads(manifest.to_json()))
        if isinstance(self.key, ed25519.Ed25519PrivateKey):
            algorithm, value = "ed25519", self.key.sign(message)
        else:
            algorithm, value = "ecdsa-sha256", self.key.sign(message, ec.ECDSA(hashes.SHA256()))
        signature = Signature(algorithm, self.key_id, base64.b64encode(value).decode())
        return replace(manifest, signature=signature)


def load_signer(path: str) -> Signer:
    """The private key (PEM, unencrypted, Ed25519 or ECDSA) at ``path``; :class:`InvalidKey` otherwise."""
    data = _read_key_file(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise InvalidKey(
            f"{path}: not an unencrypted PEM private key ({e}); give the private.pem that `vllm-sharded keygen` "
            "writes, or an unencrypted Ed25519 or ECDSA key."
        ) from e
    if not isinstance(key, (ed25519.Ed25519PrivateKey, ec.EllipticCurvePrivateKey)):
        raise InvalidKey(f"{path}: a {type(key).__name__}; signing takes an Ed25519 or ECDSA key (keygen).")
    return Signer(path, key)


def configured_signer() -> Signer | None:
    """The key in ``SHARDED_STATE_SIGNING_KEY`` (None where it is unset); :class:`InvalidKey` if unusable."""
    path = os.environ.get(SIGNING_KEY_ENV, "").strip()
    return load_signer(path) if path else None


def trusted_keys() -> tuple[dict[str, tuple[str, PublicKey]], list[str]]:
    """The trusted public keys by key id, with their file; and a sentence for each file that gives none."""
    keys: dict[str, tuple[str, PublicKey]] = {}
    problems: list[str] = []
    for path in filter(None, os.environ.get(TRUSTED_KEYS_ENV, "").split(os.pathsep)):
        try:
            data = _read_key_file(path, "trusted public key")
        except InvalidKey as e:
            problems.append(str(e))
            continue
        found = 0
        for block in data.split(PEM_PUBLIC_KEY)[1:]:
            try:
                key = serialization.load_pem_public_key(PEM_PUBLIC_KEY + block)
            except (ValueError, UnsupportedAlgorithm):
                continue
            if isinstance(key, (ed25519.Ed25519PublicKey, ec.EllipticCurvePublicKey)):
                keys[key_id(key)] = (path, key)
                found += 1
        if not found:
            problems.append(f"{path} holds no Ed25519 or ECDSA public key in PEM (BEGIN PUBLIC KEY)")
    return keys, problems


@dataclass(frozen=True)
class Verdict:
    """Whether the code a manifest names may run here, and in one sentence why (what to set, if not)."""

    trusted: bool
    reason: str
    signer: str | None = None


def _verifies(signature: Signature, key: PublicKey, message: bytes) -> bool:
    try:
        value = base64.b64decode(signature.value, validate=True)
        if isinstance(key, ed25519.Ed25519PublicKey) and signature.algorithm == "ed25519":
            key.verify(value, message)
        elif isinstance(key, ec.EllipticCurvePublicKey) and signature.algorithm == "ecdsa-sha256":
            key.verify(value, message, ec.ECDSA(hashes.SHA256()))
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


def check_trust(manifest: Manifest) -> Verdict:
    """Whether ``manifest`` (as parsed) is signed by a key in ``SHARDED_STATE_TRUSTED_KEYS``."""
    signature = manifest.signature
    if signature is None:
        return Verdict(
            False,
            f"the checkpoint is not signed; sign it with `vllm-sharded sign CHECKPOINT --key PRIVATE.pem` (or save it "
            f"with {SIGNING_KEY_ENV} set) and list its public key in {TRUSTED_KEYS_ENV}",
        )
    signer = signature.short_id
    keys, problems = trusted_keys()
    if not keys:
        setting = f"{TRUSTED_KEYS_ENV} gives no trusted key" + (f" ({'; '.join(problems)})" if problems else "")
        return Verdict(
            False, f"signed by key {signer}, but {setting}; set it to the signer's public key (PEM) to trust it", signer
        )
    if signature.key_id not in keys:
        files = ", ".join(dict.fromkeys(path for path, _ in keys.values()))
        return Verdict(
            False,
            f"signed by key {signer}, which is not among the keys trusted in {TRUSTED_KEYS_ENV} ({files}); add the "
            "signer's public key there if you trust it",
            signer,
        )
    path, key = keys[signature.key_id]
    if not manifest.signed_message or not _verifies(signature, key, manifest.signed_message):
        return Verdict(
            False,
            f"the signature by key {signer} does not match the manifest: the checkpoint was changed after it was "
            "signed; sign it again only once you trust what it holds",
            signer,
        )
    return Verdict(True, f"signed by key {signer}, trusted ({path})", signer)


def keygen(folder: str) -> tuple[str, str]:
    """Write a new Ed25519 key pair into ``folder`` (private.pem 0600, public.pem), never over a file."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    paths = (os.path.join(folder, "private.pem"), os.path.join(folder, "public.pem"))
    for path in paths:
        if os.path.lexists(path):
            raise InvalidKey(f"{path} exists; nothing was written. Choose another folder, or move the old keys away.")
    written = []
    try:
        for path, data, mode in ((paths[0], private, 0o600), (paths[1], public, 0o644)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            written.append(path)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
    except BaseException:
        for path in written:
            os.remove(path)
        raise
    return paths
