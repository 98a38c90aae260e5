"""A checkpoint in a local directory (or a Hugging Face cache snapshot): its manifest, its part files.

A load opens each part once (:func:`open_part`) and does everything else through that descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..format.errors import CheckpointCorrupt, CheckpointNotFound, SaveRefused, ShardedStateError, StorageError
from ..format.manifest import MAX_MANIFEST_BYTES, FileEntry, Manifest
from ..format.names import (
    DEFAULT_PATTERNS,
    MANIFEST_NAME,
    is_part_name,
    is_startup_artifacts_name,
)
from ..format.safetensors import MAX_HEADER_BYTES, Header, parse_header
from . import oscalls

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a link to nothing",  # seen only through lstat: a dangling link
}


def file_kind(mode: int, other: str = "not a regular file") -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``other`` for a kind not named)."""
    return _KINDS.get(stat.S_IFMT(mode), other)


def not_regular(path: str, mode: int | None) -> CheckpointCorrupt:
    """The error for ``path`` of ``mode`` (None: a loop of links) where a regular file should be."""
    kind = "a loop of symbolic links" if mode is None else file_kind(mode)
    return CheckpointCorrupt(
        f"{path} is {kind}, where a regular file was expected; refusing to read it. Replace it with the "
        "real file (copy or save the checkpoint again)."
    )


def denied(path: str) -> StorageError:
    """The error for ``path``, which this process may not read (``EACCES``, ``EPERM``)."""
    return StorageError(
        f"{path}: permission denied to this process (uid {os.geteuid()}); nothing was changed. Give this "
        "user read access to it and to the folders above it (chmod, chown), or run as a user who has it."
    )


def list_folder(directory: str) -> list[str]:
    """The names in ``directory`` (``os.listdir``), a folder this process may not read named as such."""
    try:
        return os.listdir(directory)
    except PermissionError:
        raise denied(directory) from None


def present(path: str, folder: str) -> bool:
    """Whether ``path`` exists (a link to nothing too); a ``folder`` this process may not search is
    named (:func:`denied`), never taken for one without the file."""
    try:
        os.lstat(path)
    except PermissionError:
        raise denied(folder) from None
    except OSError:
        return False
    return True


def check_output_folder(directory: str) -> None:
    """Refuse an output path that is, or lies under, something other than a folder, saying which."""
    there = os.path.abspath(directory)
    while not os.path.lexists(there):
        there = os.path.dirname(there)
    if os.path.isdir(there):
        return
    mode = os.stat(there).st_mode if os.path.exists(there) else os.lstat(there).st_mode
    where = directory if there == os.path.abspath(directory) else f"{directory}: {there}"
    kind = file_kind(mode, "a file")
    raise SaveRefused(
        f"{where} is {kind}, where a checkpoint folder was expected; nothing was written. Choose another output folder."
    )


def not_a_folder(directory: str) -> str | None:
    """Why ``directory`` is no folder, in words for a message, or None for a folder."""
    if os.path.isdir(directory):
        return None
    try:
        mode = os.stat(directory).st_mode if os.path.exists(directory) else os.lstat(directory).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:  # a loop of links, a file on the way, no permission
        return f"cannot be read as a folder ({e.strerror})"
    return f"is {file_kind(mode, 'a file')}"


def make_output_folder(directory: str) -> None:
    """Make the output folder and its parents, after :func:`check_output_folder`."""
    check_output_folder(directory)
    os.makedirs(directory, exist_ok=True)


def open_regular(path: str) -> int:
    """Open an untrusted path for reading, refusing anything but a regular file (never blocking on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError:
        raise denied(path) from None
    except OSError as e:  # what open(2) itself refuses: a socket (ENXIO), a loop of links (ELOOP)
        if e.errno not in (errno.ENXIO, errno.ELOOP):
            raise
        raise not_regular(path, None if e.errno == errno.ELOOP else os.stat(path).st_mode) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_manifest(directory: str) -> Manifest | None:
    """The checkpoint's manifest, or None for a checkpoint written by vLLM's own save."""
    path = os.path.join(directory, MANIFEST_NAME)
    if not present(path, directory):
        return None
    part_path(directory, MANIFEST_NAME)  # containment before the open
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:
                raise CheckpointCorrupt(
                    f"{path}: {size} bytes, more than a manifest may hold ({MAX_MANIFEST_BYTES}); it is not one "
                    "this package wrote. Save the checkpoint again."
                )
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        # A link to nothing, or removed meanwhile: never read as a checkpoint without manifest (unchecked).
        target = None
        with contextlib.suppress(OSError):
            target = os.readlink(path)
        raise CheckpointNotFound(
            f"{path}: a symbolic link to {target}, which does not exist; the checkpoint's manifest cannot be read. "
            "Fetch or copy the checkpoint again."
            if target is not None
            else f"{path}: removed while it was being read. Load again once the checkpoint is in place."
        ) from None
    return Manifest.from_json(text, where=path)


def containment_roots(directory: str) -> tuple[str, ...]:
    """The folders a checkpoint's files may resolve into: the folder itself, and for a Hugging Face
    cache snapshot its repository's ``blobs`` (wherever that resolves), nothing else of the repository."""
    real = os.path.realpath(directory)
    snapshots, repo = os.path.dirname(real), os.path.dirname(os.path.dirname(real))
    blobs = os.path.join(repo, "blobs")
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(blobs):
        return real, os.path.realpath(blobs)
    return (real,)


def escapes(path: str, real: str, directory: str) -> ShardedStateError | None:
    """The error for ``path`` (resolving to ``real``) if it resolves outside the checkpoint ``directory``."""
    roots = containment_roots(directory)
    if any(os.path.commonpath([real, root]) == root for root in roots):
        return None
    if len(roots) > 1:
        snapshot, blobs = roots
        repo = os.path.dirname(os.path.dirname(snapshot))
        return CheckpointCorrupt(
            f"{path} resolves to {real}, outside the checkpoint directory {snapshot}, a snapshot of the Hub cache "
            f"whose files are links into its repository's blobs/ ({blobs}); refusing to read it. Delete {repo} and "
            "fetch it again."
        )
    return CheckpointCorrupt(
        f"{path} resolves to {real}, outside the checkpoint directory {roots[0]} (a symlink or path "
        "that escapes it); refusing to read it. Copy the real file into the checkpoint."
    )


def part_path(directory: str, name: str) -> str:
    """The path of a part file, refusing one that resolves outside the checkpoint directory."""
    path = os.path.join(directory, name)
    error = escapes(path, os.path.realpath(path), directory)
    if error is not None:
        raise error
    return path


def links_out(directory: str, names: Iterable[str]) -> list[ShardedStateError]:
    """The error of each of the checkpoint's files ``names`` that resolves outside ``directory``."""
    found = (escapes(path, os.path.realpath(path), directory) for path in (os.path.join(directory, n) for n in names))
    return [error for error in found if error is not None]


@dataclass(frozen=True)
class FileIdentity:
    """What tells one version of a file from another; ctime catches a rewrite with its mtime put back."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class OpenFile:
    """A file opened once: its checks, reads and mappings all go through this descriptor, so a file
    renamed over the path during a load is never read (:meth:`check_unchanged` tells it happened)."""

    mappable, remote = True, False

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd
        self.identity = FileIdentity.of(os.fstat(fd))

    @classmethod
    def open(cls, path: str) -> OpenFile:
        """Open ``path`` for reading; a missing file is a :class:`CheckpointNotFound`."""
        try:
            return cls(path, open_regular(path))
        except FileNotFoundError:
            raise CheckpointNotFound(f"{path}: file is missing. Copy or save the checkpoint again.") from None

    @property
    def size(self) -> int:
        return self.identity.size

    def real_path(self) -> str:
        """Where the opened file really is, read off the descriptor."""
        try:
            return os.readlink(f"/proc/self/fd/{self.fd}")
        except OSError:  # no /proc: resolve the path instead
            return os.path.realpath(self.path)

    def reopen(self) -> int:
        """A new descriptor of the same file, with its own file position and readahead."""
        try:
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY)
        except OSError:  # no /proc: share this descriptor's open file (reads use pread)
            return os.dup(self.fd)

    def read_at(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the file)."""
        return os.pread(self.fd, length, offset)

    def stream(self) -> FileStream:
        """A reader for one thread, with its own descriptor and readahead (:class:`FileStream`)."""
        return FileStream(self.path, self.reopen())

    def identity_now(self) -> FileIdentity:
        """The open file's identity now (:attr:`identity`: when opened)."""
        return FileIdentity.of(os.fstat(self.fd))

    def check_unchanged(self) -> None:
        """Raise unless the file is still the one opened, unmodified, and still at its path."""
        now = self.identity_now()
        try:
            at_path: FileIdentity | None = FileIdentity.of(os.stat(self.path))
        except FileNotFoundError:
            at_path = None
        if now != self.identity or at_path != self.identity:
            raise CheckpointCorrupt(
                f"{self.path}: the file was replaced or modified during the load (another save into the "
                "directory?); the weights read may mix two checkpoints. Load again once the save is done."
            )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileStream:
    """One thread's sequential stream through an opened file: its own descriptor, so its own readahead."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # doubles the readahead window
        self.window = oscalls.read_ahead_window(fd)

    def prefetch(self, begin: int, end: int) -> None:
        """Start reading ``[begin, end)`` into the page cache (:func:`.oscalls.will_need`)."""
        oscalls.will_need(self.fd, begin, end, self.window)

    def readv(self, views: list[memoryview], offset: int) -> None:
        preadv_all(self.fd, views, offset, self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


try:
    IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
except (AttributeError, ValueError, OSError):
    IOV_MAX = 16


def preadv_all(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill ``views`` with consecutive bytes of ``fd`` from ``offset``, across short reads."""
    index = 0
    while index < len(views):
        n = os.preadv(fd, views[index : index + IOV_MAX], offset)
        if n <= 0:
            raise truncated(path, offset)
        offset += n
        while index < len(views) and n >= len(views[index]):
            n -= len(views[index])
            index += 1
        if n:
            views[index] = views[index][n:]


def truncated(path: str, offset: int) -> ShardedStateError:
    return CheckpointCorrupt(
        f"{path}: file ended at byte {offset} while reading; it is truncated or was replaced during "
        "the load. Copy or save the checkpoint again."
    )


def open_part(directory: str, f: FileEntry) -> OpenFile:
    """Open a part file the manifest lists: inside the checkpoint, present, with its recorded size."""
    path = os.path.join(directory, f.name)
    try:
        part_path(directory, f.name)  # containment first: a link out (to a device, say) is never opened
        opened = OpenFile(path, open_regular(path))
    except FileNotFoundError:
        raise CheckpointNotFound(
            f"{path}: listed in {MANIFEST_NAME} ({f.size} bytes) but missing. The checkpoint is "
            "incomplete: copy the missing file or save the checkpoint again."
        ) from None
    error = escapes(path, opened.real_path(), directory)
    if error is None and opened.size != f.size:
        error = CheckpointCorrupt(
            f"{path}: {opened.size} bytes on disk, but {MANIFEST_NAME} records {f.size}. The file is "
            f"{'truncated' if opened.size < f.size else 'not the one that was saved'}: copy or save the "
            "checkpoint again."
        )
    if error is not None:
        opened.close()
        raise error
    return opened


def read_header(source: str | OpenFile) -> Header:
    """Read and validate the header of a safetensors file, given its path or any opened file."""
    if isinstance(source, str):
        with OpenFile.open(source) as opened:
            return read_header(opened)
    raw_length = source.read_at(0, 8)
    length = struct.unpack("<Q", raw_length)[0] if len(raw_length) == 8 else 0
    raw_header = source.read_at(8, length) if length <= min(MAX_HEADER_BYTES, source.size) else b""
    return parse_header(raw_length, raw_header, source.path, source.size)


def directory_holds_checkpoint(directory: str, patterns: Sequence[str] = ()) -> bool:
    """Whether a directory holds any checkpoint file (:func:`is_checkpoint_file`)."""
    try:
        names = list_folder(directory)
    except FileNotFoundError:
        return False
    return any(is_checkpoint_file(n, patterns) for n in names)


def is_checkpoint_file(name: str, patterns: Sequence[str] = ()) -> bool:
    """Whether a file name is a checkpoint's: its manifest, a part (default names or ``patterns``), or
    start-up artifacts; a save's cleanup removes those its manifest does not list."""
    return (
        name == MANIFEST_NAME or is_part_name(name, (*DEFAULT_PATTERNS, *patterns)) or is_startup_artifacts_name(name)
    )


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(directory: str, name: str, data: bytes, temporary: str | None = None) -> None:
    """Write ``directory/name`` whole or not at all: temporary file (``temporary``, a save's staged
    name that a later cleanup removes, or a fresh one), fsync, rename, fsync of the folder."""
    if temporary is None:
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    else:
        temporary = os.path.join(directory, temporary)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temporary, 0o644)  # as the parts
        os.replace(temporary, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    fsync_directory(directory)
