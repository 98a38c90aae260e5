"""Key pairs for the tests that sign checkpoints (``vllm-sharded keygen``'s), and the settings that use them."""

from __future__ import annotations

import os
import tempfile
from functools import cache
from pathlib import Path

from vllm_sharded_loader.checkpoint.trust import SIGNING_KEY_ENV, TRUSTED_KEYS_ENV, keygen
from vllm_sharded_loader.storage.location import open_store


def key_pair(name: str = "operator") -> tuple[str, str]:
    """(private.pem, public.pem) of a key pair made once per process under ``name``."""
    return _key_pair(name)


@cache
def _key_pair(name: str) -> tuple[str, str]:
    return keygen(os.path.join(tempfile.mkdtemp(prefix=f"vsl-keys-{name}-"), name))


def signing(name: str = "operator") -> dict[str, str]:
    """The environment of a save that signs with ``name``'s key."""
    return {SIGNING_KEY_ENV: key_pair(name)[0]}


def trusting(*names: str) -> dict[str, str]:
    """The environment of a server that trusts ``names``' keys (the operator's by default)."""
    return {TRUSTED_KEYS_ENV: os.pathsep.join(key_pair(n)[1] for n in names or ("operator",))}


def signed_and_trusted(name: str = "operator") -> dict[str, str]:
    """Both: a save signs with ``name``'s key, and a load trusts it."""
    return {**signing(name), **trusting(name)}


def sign_again(where: str | Path, name: str = "operator") -> None:
    """Sign the checkpoint at ``where`` again with ``name``'s key, as ``vllm-sharded sign`` does
    (after a test edited its manifest, as only its operator may)."""
    from vllm_sharded_loader.checkpoint.startup_artifacts import sign_checkpoint
    from vllm_sharded_loader.checkpoint.trust import load_signer

    sign_checkpoint(open_store(str(where)), load_signer(key_pair(name)[0]))
