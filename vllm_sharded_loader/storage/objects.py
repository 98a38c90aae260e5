"""A checkpoint in object storage (``s3://``, ``gs://``, ``az://``): its manifest and parts.

Through `obstore <https://developmentseed.org/obstore>`_, whose requests release the GIL. A part is
opened once (one ``HEAD``); every later read is a ranged ``GET`` conditional on that version
(``If-Match`` its ETag, on GCS its generation), so an object replaced during a load fails the read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..format.errors import (
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointNotFound,
    InvalidOption,
    ShardedStateError,
    StorageError,
)
from ..format.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest
from ..format.names import MANIFEST_NAME
from .object_clients import AZURE_BLOB_HOST, CLIENTS, SETTINGS, _store, check_not_forked
from .object_clients import AZURE_CONNECTION_STRING_ENV as AZURE_CONNECTION_STRING_ENV  # re-exported: one name
from .object_clients import azure_connection_string as azure_connection_string  # for every setting of a store

UPLOAD_CHUNK_BYTES = 64 * 1024 * 1024  # multipart chunks (S3's minimum is 5 MiB)
UPLOAD_CONCURRENCY = 8
MAX_SMALL_FILE_BYTES = 1 << 31  # non-weight files are read whole


def _is_azure_https(url: str) -> bool:
    parsed = urlparse(url)
    return parsed.scheme.lower() == "https" and (parsed.hostname or "").lower().endswith(AZURE_BLOB_HOST)


def is_object_url(where: str) -> bool:
    """Whether ``where`` names object storage (a scheme in :data:`.object_clients.CLIENTS`, or an Azure blob URL)."""
    scheme, sep, _ = where.partition("://")
    return (bool(sep) and scheme.lower() in CLIENTS) or _is_azure_https(where)


@dataclass(frozen=True)
class ObjectPrefix:
    """A bucket (an Azure container) and a key prefix acting as the checkpoint's folder; ``account``
    is the Azure account an ``https://ACCOUNT.blob.core.windows.net/`` URL names (None: the environment's)."""

    bucket: str
    prefix: str  # "" or ending in "/"
    scheme: str = "s3"
    account: str | None = None

    @classmethod
    def parse(cls, url: str) -> ObjectPrefix:
        if "?" in url or "#" in url:  # the parser would drop it silently
            raise InvalidOption(
                f"{url}: an object storage URL names a bucket and a prefix only; its '?' or '#' part (a version, "
                "a token, or a key with such a character) would be ignored. Give the prefix alone, with credentials "
                "in the environment; copy an object's past version to a prefix of its own to use it."
            )
        parsed = urlparse(url)
        scheme = parsed.scheme.lower()
        path = parsed.path.strip("/")
        if _is_azure_https(url):
            container, _, prefix = path.partition("/")
            account = (parsed.hostname or "")[: -len(AZURE_BLOB_HOST)]
            if not container or not account:
                raise InvalidOption(
                    f"{url}: an Azure blob URL must name the container: "
                    "https://ACCOUNT.blob.core.windows.net/CONTAINER/prefix."
                )
            _check_segments(url, prefix)
            return cls(container, prefix + "/" if prefix else "", "az", account)
        if scheme not in CLIENTS or not parsed.netloc:
            raise InvalidOption(
                f"{url}: not an object storage URL of the form s3://bucket/prefix, gs://bucket/prefix, "
                "az://container/prefix or https://ACCOUNT.blob.core.windows.net/container/prefix."
            )
        _check_segments(url, path)
        return cls(parsed.netloc, path + "/" if path else "", scheme)

    def key(self, name: str) -> str:
        return self.prefix + name

    def url(self, name: str = "") -> str:
        if self.account is not None:
            return f"https://{self.account}{AZURE_BLOB_HOST}/{self.bucket}/{self.prefix}{name}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}{name}"

    def store(self) -> Any:
        """The obstore client of this bucket (one per bucket and process)."""
        check_not_forked(self.url())
        return _store(self.scheme, self.bucket, self.account)


def _check_segments(url: str, prefix: str) -> None:
    """Refuse a prefix with an empty, ``.`` or ``..`` part: keys are not paths, nothing resolves them."""
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise InvalidOption(
            f"{url}: its prefix {prefix!r} has an empty, '.' or '..' part, which object storage does not resolve "
            "as a folder path would; nothing was read or written. Give the prefix without them (s3://bucket/a/b)."
        )


def _error_type(error: Exception) -> type[ShardedStateError]:
    """Our error type for one of obstore's: the checkpoint's state, else :class:`StorageError`."""
    import obstore.exceptions as oe

    if isinstance(error, (FileNotFoundError, oe.NotFoundError)):
        return CheckpointNotFound
    if isinstance(error, oe.PreconditionError):  # an If-Match read: the object changed since it was opened
        return CheckpointCorrupt
    if isinstance(error, oe.AlreadyExistsError):  # a create-only put: another save holds or published it
        return CheckpointLocked
    return StorageError


def _fail(url: str, what: str, error: Exception) -> ShardedStateError:
    if isinstance(error, ShardedStateError):
        return error
    # Not parsed: an object's name may hold a '#' or '?'.
    settings = SETTINGS["az" if _is_azure_https(url) else url.partition(":")[0].lower()]
    return _error_type(error)(
        f"{url}: {what} failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
        f"Check the endpoint and credentials ({settings}) and that the object storage is reachable."
    )


def head(where: ObjectPrefix, name: str) -> dict[str, Any] | None:
    """An object's metadata (``size``, ``e_tag``), or None if there is no such object."""
    import obstore

    try:
        return obstore.head(where.store(), where.key(name))
    except FileNotFoundError:
        return None
    except Exception as e:
        raise _fail(where.url(name), "HEAD", e) from e


class ObjectFile:
    """A part in object storage, opened once: its size and ETag, then conditional ranged reads
    (the interface of :class:`.local.OpenFile`, never mapped)."""

    mappable, remote = False, True

    def __init__(self, where: ObjectPrefix, name: str, meta: dict[str, Any]) -> None:
        self.where, self.name, self.path = where, name, where.url(name)
        self.key = where.key(name)
        self.size: int = meta["size"]
        self.etag: str | None = meta.get("e_tag")
        # GCS's generation, named too: a store that ignores If-Match still serves only this object.
        self.version: str | None = meta.get("version") if where.scheme == "gs" else None

    @classmethod
    def open(cls, where: ObjectPrefix, name: str, missing: str | None = None) -> ObjectFile:
        meta = head(where, name)
        if meta is None:
            raise CheckpointNotFound(missing or f"{where.url(name)}: object is missing. Save the checkpoint again.")
        return cls(where, name, meta)

    def read_at(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the object)."""
        return bytes(self._get(offset, length))

    def _get(self, offset: int, length: int) -> memoryview:
        """One conditional ranged GET; its bytes in the client's own buffer (no copy)."""
        import obstore

        end = min(offset + length, self.size)
        if end <= offset:
            return memoryview(b"")
        options: dict[str, Any] = {"range": (offset, end)}
        if self.etag:
            options["if_match"] = self.etag
        if self.version:
            options["version"] = self.version
        try:
            return memoryview(obstore.get(self.where.store(), self.key, options=options).bytes())
        except obstore.exceptions.PreconditionError:
            raise self._replaced() from None
        except FileNotFoundError:
            raise self._replaced() from None
        except Exception as e:
            raise _fail(self.path, f"GET of bytes {offset}-{end}", e) from e

    def stream(self) -> ObjectFile:
        """A reader for one thread (each read is its own request)."""
        return self

    def readv(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` with consecutive bytes from ``offset``: one ranged GET."""
        total = sum(len(v) for v in views)
        data = self._get(offset, total)
        if len(data) < total:
            raise CheckpointCorrupt(
                f"{self.path}: object ended at byte {offset + len(data)} while reading; it is truncated or was "
                "replaced during the load. Copy or save the checkpoint again."
            )
        position = 0
        for view in views:
            view[:] = data[position : position + len(view)]
            position += len(view)

    def check_unchanged(self) -> None:
        """Raise unless the object is still the one opened (same ETag and size)."""
        meta = head(self.where, self.name)
        if meta is None or meta["size"] != self.size or meta.get("e_tag") != self.etag:
            raise self._replaced()
        if self.version is not None and meta.get("version") != self.version:
            raise self._replaced()

    def _replaced(self) -> ShardedStateError:
        return CheckpointCorrupt(
            f"{self.path}: the object was replaced or deleted during the load (another save into the "
            "prefix?); the weights read may mix two checkpoints. Load again once the save is done."
        )

    def close(self) -> None:
        pass

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_part(where: ObjectPrefix, f: FileEntry) -> ObjectFile:
    """Open a part the manifest lists: present, with its recorded size."""
    opened = ObjectFile.open(
        where,
        f.name,
        missing=f"{where.url(f.name)}: listed in {MANIFEST_NAME} ({f.size} bytes) but missing. The checkpoint is "
        "incomplete: upload the missing object or save the checkpoint again.",
    )
    if opened.size != f.size:
        raise CheckpointCorrupt(
            f"{opened.path}: {opened.size} bytes in the store, but {MANIFEST_NAME} records {f.size}. The object is "
            f"{'truncated' if opened.size < f.size else 'not the one that was saved'}: upload it again or save the "
            "checkpoint again."
        )
    return opened


def read_manifest(where: ObjectPrefix) -> Manifest | None:
    """The checkpoint's manifest, or None if the prefix has none."""
    meta = head(where, MANIFEST_NAME)
    if meta is None:
        return None
    url = where.url(MANIFEST_NAME)
    if meta["size"] > MAX_MANIFEST_BYTES:
        raise CheckpointCorrupt(
            f"{url}: {meta['size']} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES}); it is not one "
            "this package wrote. Save the checkpoint again."
        )
    text = ObjectFile(where, MANIFEST_NAME, meta).read_at(0, meta["size"])
    return Manifest.from_json(text.decode("utf-8", errors="replace"), where=url)


def list_names(where: ObjectPrefix) -> list[str]:
    """Names of the objects directly under the prefix."""
    import obstore

    try:
        listing = obstore.list_with_delimiter(where.store(), where.prefix or None)
    except Exception as e:
        raise _fail(where.url(), "LIST", e) from e
    return sorted(o["path"][len(where.prefix) :] for o in listing["objects"])


def list_tree(where: ObjectPrefix) -> list[str]:
    """Relative names of every object under the prefix, in sub-folders too."""
    import obstore

    try:
        batches = obstore.list(where.store(), where.prefix or None)
        return sorted(o["path"][len(where.prefix) :] for batch in batches for o in batch)
    except Exception as e:
        raise _fail(where.url(), "LIST", e) from e


def read_object(where: ObjectPrefix, name: str) -> bytes:
    """A whole (small) object: a config or tokenizer file."""
    return ObjectFile.open(where, name).read_at(0, MAX_SMALL_FILE_BYTES)


# ---------------------------------------------------------------------- writing


class AlreadyExists(ShardedStateError):
    """A conditional put found the object there already."""


def put(
    where: ObjectPrefix, name: str, data: bytes | Path, *, create: bool = False, match: dict[str, Any] | None = None
) -> None:
    """Write one object from bytes or a local file (large ones as parallel multipart uploads).

    ``create``: only if no object has that name; ``match``: only over the object :func:`head`
    described. Otherwise :class:`AlreadyExists` says who was first.
    """
    import obstore

    mode: Any = "create" if create else "overwrite"
    if match is not None:  # S3 and Azure compare the ETag, GCS the generation ("version")
        mode = {k: match[k] for k in ("e_tag", "version") if match.get(k) is not None}
    try:
        obstore.put(
            where.store(),
            where.key(name),
            data,
            mode=mode,
            chunk_size=UPLOAD_CHUNK_BYTES,
            max_concurrency=UPLOAD_CONCURRENCY,
        )
    except obstore.exceptions.AlreadyExistsError:
        raise AlreadyExists(f"{where.url(name)}: already exists; another save published or holds it first.") from None
    except obstore.exceptions.PreconditionError:
        now = None if match is None else head(where, name)
        if match is not None and (now is None or any(now.get(k) != v for k, v in mode.items())):
            raise AlreadyExists(f"{where.url(name)}: replaced by another save meanwhile; it published first.") from None
        # Azure answers 412 to any write of a leased blob, conditional or not: no save replaced it.
        raise StorageError(
            f"{where.url(name)}: the store refused the write (412 Precondition Failed), though no other save "
            "replaced the object: on Azure, a lease is held on the blob. Release or break the lease, then save again."
        ) from None
    except Exception as e:
        raise _fail(where.url(name), "upload", e) from e


def delete(where: ObjectPrefix, names: Iterable[str]) -> None:
    """Delete objects under the prefix; absent ones are not an error."""
    import obstore

    keys = [where.key(n) for n in names]
    if not keys:
        return
    try:
        obstore.delete(where.store(), keys)
    except FileNotFoundError:  # Azure's and GCS's batches may stop at a missing key: one by one
        for key in keys:
            try:
                obstore.delete(where.store(), key)
            except FileNotFoundError:
                pass
            except Exception as e:
                raise _refused_delete(where, f"DELETE of {key}", e) from e
    except Exception as e:
        raise _refused_delete(where, f"DELETE of {len(keys)} objects", e) from e


def _refused_delete(where: ObjectPrefix, what: str, error: Exception) -> ShardedStateError:
    """A failed delete's error; Azure's 412 for a leased blob is named, as no credential fixes it."""
    import obstore.exceptions as oe

    if isinstance(error, oe.PreconditionError) or "(code: 412)" in str(error):
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        return StorageError(
            f"{where.url()}: the store refused the {what} (412 Precondition Failed: {detail}): on Azure, a lease is "
            "held on the blob. Release or break the lease, then save again."
        )
    return _fail(where.url(), what, error)


def abort_incomplete_uploads(where: ObjectPrefix, names: Iterable[str] | Callable[[str], bool]) -> int:
    """Abort the unfinished multipart uploads of these objects (a dead save's); returns how many.

    ``names``: names under the prefix, or (S3 only) a test of a name directly under it. S3 only,
    and only with ``boto3`` (obstore cannot list uploads); elsewhere, and without it, the bucket's
    lifecycle rules (or Azure's 7-day expiry of uncommitted blocks) collect them.
    """
    if where.scheme != "s3":
        return 0
    if callable(names):
        wanted = names
    else:
        keys = {where.key(n) for n in names}
        if not keys:
            return 0
        wanted = lambda name: where.key(name) in keys  # noqa: E731
    prefix_length = len(where.key(""))
    try:
        import boto3
    except ImportError:
        return 0
    client = boto3.Session().client("s3")
    aborted = 0
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=where.bucket, Prefix=where.prefix):
            for upload in page.get("Uploads", []):
                name = upload["Key"][prefix_length:]
                if "/" not in name and wanted(name):
                    client.abort_multipart_upload(Bucket=where.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    aborted += 1
    except Exception as e:
        raise _fail(where.url(), "aborting unfinished multipart uploads", e) from e
    return aborted
