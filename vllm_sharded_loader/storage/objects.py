"""A checkpoint in object storage (``s3://bucket/prefix``): its manifest, its parts, its lock.

The client is `obstore <https://developmentseed.org/obstore>`_ (Rust's ``object_store``
crate): every request releases the GIL, so the reader's threads run their ranged GETs
truly in parallel, and multipart uploads and conditional puts are built in. Credentials,
region and endpoint are resolved by ``boto3`` when it is installed, so every usual AWS
setting applies (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` and
``~/.aws/config``, SSO, instance roles), and otherwise by ``obstore`` from the
``AWS_*`` environment variables. Nothing here has settings of its own.

A part is opened once (:class:`ObjectFile`: one ``HEAD``), and every later read of it is
a ranged ``GET`` conditional on the ETag seen then (``If-Match``): an object replaced
during a load is never read, it fails the read. :meth:`ObjectFile.check_unchanged` tells
the same after the reads.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..format.errors import ShardedStateError
from ..format.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest
from ..format.names import LOCK_NAME, MANIFEST_NAME

SCHEMES = ("s3://",)
# Parts are uploaded in chunks of this size (S3's minimum is 5 MiB), several at once.
UPLOAD_CHUNK_BYTES = 64 * 1024 * 1024
UPLOAD_CONCURRENCY = 8
# Non-weight files (config, tokenizer) are read whole; none comes near this.
MAX_SMALL_FILE_BYTES = 1 << 31


def is_object_url(where: str) -> bool:
    """Whether ``where`` names a checkpoint in object storage rather than a local folder."""
    return where.lower().startswith(SCHEMES)


@dataclass(frozen=True)
class ObjectPrefix:
    """``s3://bucket/prefix``: a bucket and a key prefix acting as the checkpoint's folder."""

    bucket: str
    prefix: str  # "" or ending in "/"

    @classmethod
    def parse(cls, url: str) -> ObjectPrefix:
        parsed = urlparse(url)
        if parsed.scheme.lower() != "s3" or not parsed.netloc:
            raise ShardedStateError(f"{url}: not an object storage URL of the form s3://bucket/prefix.")
        prefix = parsed.path.strip("/")
        return cls(parsed.netloc, prefix + "/" if prefix else "")

    def key(self, name: str) -> str:
        return self.prefix + name

    def url(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"


# Every request is bounded: per-request and connect timeouts, and retries with exponential
# backoff (with jitter) bounded in count and in total time, in obstore's own settings. Ours
# are the defaults; these variables set them (seconds; retries as AWS_MAX_ATTEMPTS counts attempts).
TIMEOUT_ENV = "SHARDED_STATE_S3_TIMEOUT"
CONNECT_TIMEOUT_ENV = "SHARDED_STATE_S3_CONNECT_TIMEOUT"
RETRY_TIMEOUT_ENV = "SHARDED_STATE_S3_RETRY_TIMEOUT"
DEFAULT_TIMEOUT_S, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_RETRY_TIMEOUT_S, DEFAULT_ATTEMPTS = 60.0, 10.0, 180.0, 6


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    try:
        seconds = float(value) if value else default
    except ValueError:
        raise ShardedStateError(f"{name}={value!r} is not a number of seconds.") from None
    if not seconds > 0:
        raise ShardedStateError(f"{name}={value!r} must be a positive number of seconds.")
    return seconds


def client_settings(allow_http: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """obstore's ``client_options`` and ``retry_config`` for every store of ours (see the constants above)."""
    attempts = os.environ.get("AWS_MAX_ATTEMPTS")
    try:
        retries = max(int(attempts) - 1, 0) if attempts else DEFAULT_ATTEMPTS - 1
    except ValueError:
        raise ShardedStateError(f"AWS_MAX_ATTEMPTS={attempts!r} is not a whole number.") from None
    client_options = {
        "allow_http": allow_http,
        "timeout": timedelta(seconds=_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)),
        "connect_timeout": timedelta(seconds=_seconds(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT_S)),
    }
    retry_config = {
        "max_retries": retries,
        "retry_timeout": timedelta(seconds=_seconds(RETRY_TIMEOUT_ENV, DEFAULT_RETRY_TIMEOUT_S)),
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=15), "base": 2},
    }
    return client_options, retry_config


@functools.cache
def _store(bucket: str) -> Any:
    """The client of one bucket, configured from the usual AWS settings (see the module doc)."""
    from obstore.store import S3Store

    try:
        import boto3
    except ImportError:  # obstore reads the AWS_* environment variables itself
        client_options, retry_config = client_settings(allow_http=True)
        return S3Store(bucket, client_options=client_options, retry_config=retry_config)
    from obstore.auth.boto3 import Boto3CredentialProvider

    session = boto3.Session()
    # The endpoint botocore would use: AWS_ENDPOINT_URL(_S3), or the profile's endpoint_url.
    endpoint = session.client("s3").meta.endpoint_url
    host = urlparse(endpoint).hostname or ""
    config: dict[str, Any] = {"region": session.region_name or "us-east-1"}
    if not host.endswith("amazonaws.com"):
        # A store of its own (MinIO, SeaweedFS, Ceph...): path-style requests to its endpoint.
        config.update(endpoint=endpoint, virtual_hosted_style_request=False)
    credentials = Boto3CredentialProvider(session) if session.get_credentials() is not None else None
    client_options, retry_config = client_settings(allow_http=endpoint.startswith("http://"))
    return S3Store(
        bucket,
        config=config,
        credential_provider=credentials,
        skip_signature=credentials is None,
        client_options=client_options,
        retry_config=retry_config,
    )


def _fail(url: str, what: str, error: Exception) -> ShardedStateError:
    return ShardedStateError(
        f"{url}: {what} failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
        "Check the endpoint and credentials (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_PROFILE) and that "
        "the object storage is reachable."
    )


def head(where: ObjectPrefix, name: str) -> dict[str, Any] | None:
    """An object's metadata (``size``, ``e_tag``), or None if there is no such object."""
    import obstore

    try:
        return obstore.head(_store(where.bucket), where.key(name))
    except FileNotFoundError:
        return None
    except Exception as e:
        raise _fail(where.url(name), "HEAD", e) from e


class ObjectFile:
    """A part in object storage, opened once: its size and ETag, then conditional ranged reads.

    The same interface as :class:`.local.OpenFile`, so the checks and the reader treat
    both alike; it cannot be mapped (:attr:`mappable`).
    """

    mappable, remote = False, True

    def __init__(self, where: ObjectPrefix, name: str, meta: dict[str, Any]) -> None:
        self.where, self.name, self.path = where, name, where.url(name)
        self.key = where.key(name)
        self.size: int = meta["size"]
        self.etag: str | None = meta.get("e_tag")

    @classmethod
    def open(cls, where: ObjectPrefix, name: str, missing: str | None = None) -> ObjectFile:
        meta = head(where, name)
        if meta is None:
            raise ShardedStateError(missing or f"{where.url(name)}: object is missing. Save the checkpoint again.")
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
        try:
            return memoryview(obstore.get(_store(self.where.bucket), self.key, options=options).bytes())
        except obstore.exceptions.PreconditionError:
            raise self._replaced() from None
        except FileNotFoundError:
            raise self._replaced() from None
        except Exception as e:
            raise _fail(self.path, f"GET of bytes {offset}-{end}", e) from e

    def stream(self) -> ObjectFile:
        """A reader for one thread: the client is shared, each read is its own request."""
        return self

    def readv(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` with consecutive bytes from ``offset``: one ranged GET."""
        total = sum(len(v) for v in views)
        data = self._get(offset, total)
        if len(data) < total:
            raise ShardedStateError(
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

    def _replaced(self) -> ShardedStateError:
        return ShardedStateError(
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
        raise ShardedStateError(
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
        raise ShardedStateError(
            f"{url}: {meta['size']} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES}); it is not one "
            "this package wrote. Save the checkpoint again."
        )
    text = ObjectFile(where, MANIFEST_NAME, meta).read_at(0, meta["size"])
    return Manifest.from_json(text.decode("utf-8", errors="replace"), where=url)


def list_names(where: ObjectPrefix) -> list[str]:
    """Names of the objects directly under the prefix."""
    import obstore

    try:
        listing = obstore.list_with_delimiter(_store(where.bucket), where.prefix or None)
    except Exception as e:
        raise _fail(where.url(), "LIST", e) from e
    return sorted(o["path"][len(where.prefix) :] for o in listing["objects"])


def list_tree(where: ObjectPrefix) -> list[str]:
    """Relative names of every object under the prefix, in sub-folders too."""
    import obstore

    try:
        batches = obstore.list(_store(where.bucket), where.prefix or None)
        return sorted(o["path"][len(where.prefix) :] for batch in batches for o in batch)
    except Exception as e:
        raise _fail(where.url(), "LIST", e) from e


def read_object(where: ObjectPrefix, name: str) -> bytes:
    """A whole (small) object: a config or tokenizer file."""
    return ObjectFile.open(where, name).read_at(0, MAX_SMALL_FILE_BYTES)


# ---------------------------------------------------------------------- writing


class AlreadyExists(ShardedStateError):
    """A conditional put found the object there already."""


def put(where: ObjectPrefix, name: str, data: bytes | Path, *, create: bool = False, match: str | None = None) -> None:
    """Write one object, from bytes or a local file; large files go up as parallel multipart uploads.

    ``create``: only if no object has that name (a conditional put, ``If-None-Match: *``);
    ``match``: only over the object of that ETag (``If-Match``); otherwise a
    :class:`ShardedStateError` says who was first.
    """
    import obstore

    mode: Any = "create" if create else "overwrite" if match is None else {"e_tag": match}
    try:
        obstore.put(
            _store(where.bucket),
            where.key(name),
            data,
            mode=mode,
            chunk_size=UPLOAD_CHUNK_BYTES,
            max_concurrency=UPLOAD_CONCURRENCY,
        )
    except obstore.exceptions.AlreadyExistsError:
        raise AlreadyExists(f"{where.url(name)}: already exists; another save published or holds it first.") from None
    except obstore.exceptions.PreconditionError:
        raise AlreadyExists(f"{where.url(name)}: replaced by another save meanwhile; it published first.") from None
    except Exception as e:
        raise _fail(where.url(name), "upload", e) from e


def delete(where: ObjectPrefix, names: Iterable[str]) -> None:
    """Delete objects under the prefix; absent ones are not an error."""
    import obstore

    keys = [where.key(n) for n in names]
    if not keys:
        return
    try:
        obstore.delete(_store(where.bucket), keys)
    except FileNotFoundError:
        pass
    except Exception as e:
        raise _fail(where.url(), f"DELETE of {len(keys)} objects", e) from e


def abort_incomplete_uploads(where: ObjectPrefix, names: Iterable[str] | Callable[[str], bool]) -> int:
    """Abort the unfinished multipart uploads of these objects (a failed save's own); returns how many.

    ``names``: the names under the prefix, or a test of a name directly under it. Only
    those uploads are touched, never another writer's under the same prefix or bucket;
    the listing is paged to its end. Needs ``boto3`` (``obstore`` cannot list uploads);
    without it, none are aborted and the store's lifecycle rules collect them.
    """
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


# ------------------------------------------------------------------------ lock


def read_lock(where: ObjectPrefix) -> dict[str, Any] | None:
    """The lock object's contents if a save holds (or held, and died holding) the prefix."""
    meta = head(where, LOCK_NAME)
    if meta is None:
        return None
    try:
        holder = json.loads(ObjectFile(where, LOCK_NAME, meta).read_at(0, min(meta["size"], 4096)))
    except (ValueError, ShardedStateError):
        holder = {}
    return holder if isinstance(holder, dict) else {}


def describe_lock(where: ObjectPrefix, holder: dict[str, Any]) -> str:
    when = holder.get("time")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) else "?"
    return f"{where.url(LOCK_NAME)} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {since})"


def acquire_lock(where: ObjectPrefix, token: str) -> None:
    """Take the prefix for one save: a conditional put of the lock object, so exactly one save wins.

    Object storage cannot tell a running save from a dead one, so a lock left by an
    interrupted save is never taken over silently: the error says to delete it.
    """
    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "token": token})
    try:
        put(where, LOCK_NAME, body.encode(), create=True)
    except AlreadyExists:
        holder = read_lock(where) or {}
        raise ShardedStateError(
            f"{where.url()}: another save holds {describe_lock(where, holder)}. If it is no longer running (it "
            f"was interrupted), delete {where.url(LOCK_NAME)} and save again."
        ) from None


def check_lock_holder(where: ObjectPrefix, token: str) -> None:
    """Fencing: refuse to go on unless the lock is still this save's (``token``).

    A lock can be deleted by hand and taken by another save while this one stalls; this
    save must then neither publish nor delete the new holder's lock.
    """
    holder = read_lock(where)
    if holder is None or holder.get("token") != token:
        raise ShardedStateError(
            f"{where.url()}: this save's lock was "
            + ("deleted" if holder is None else f"taken over by another save ({describe_lock(where, holder)})")
            + " while it ran; it does not publish. Save again once no other save runs."
        )


def release_lock(where: ObjectPrefix, token: str | None = None) -> None:
    """Delete the lock; with ``token``, only if it is still this save's.

    The read and the delete are two requests (S3 has no conditional delete everywhere):
    a lock taken over between them is the one case not fenced.
    """
    if token is not None:
        holder = read_lock(where)
        if holder is None or holder.get("token") != token:
            return
    delete(where, [LOCK_NAME])


def check_not_locked(where: ObjectPrefix) -> None:
    """Refuse a prefix without a manifest that a save holds: its first save has not published.

    A save replaces a checkpoint last (new part names, then the manifest's conditional
    put), so a published manifest names a whole checkpoint while a save runs or after it died.
    """
    holder = read_lock(where)
    if holder is not None and head(where, MANIFEST_NAME) is None:
        raise ShardedStateError(
            f"{where.url()}: a save is running or was interrupted there ({describe_lock(where, holder)}) and no "
            "manifest has been published yet. Wait for the save to finish, or save the checkpoint again."
        )
