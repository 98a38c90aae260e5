"""Each rank's start-up artifacts (vLLM's compile cache), carried in the checkpoint beside its parts.

A fresh node would otherwise compile the model again on every start. Each rank's archive is
recorded in its manifest entry with its SHA-256 and a key (versions, compile settings, topology,
rank, device); a load restores it only if the key matches exactly and the bytes check, else vLLM
compiles as usual. vLLM's model-class inspection cache (:data:`MODEL_INFO_FOLDER`) is needed before
any loader runs, so :func:`..engine.node_setup.prepare_node` restores it instead.
``SHARDED_STATE_STARTUP_ARTIFACTS=0`` turns saving and restoring off.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import platform
import tarfile
from collections.abc import Collection, Mapping

import torch

from ..format.errors import CheckpointCorrupt, CheckpointNotFound, StorageError
from ..format.manifest import FileEntry, Manifest, StartupArtifacts
from ..format.names import startup_artifacts_name
from ..storage.faults import declare, kill_point
from ..storage.location import Store, require_store
from ..storage.staged import new_token
from ..storage.temporaries import held_temporary, remove_dead_temporaries
from .trust import Signer

ENABLE_ENV = "SHARDED_STATE_STARTUP_ARTIFACTS"
# A rank's compile cache is a few MB; anything far larger is not ours.
MAX_ARCHIVE_BYTES = 2 * 1024**3
# Inductor's lock files are per process; they are never carried.
SKIPPED_FOLDERS = frozenset({"locks"})
# The archive's folder of vLLM's model-class inspection cache entries, restored under VLLM_CACHE_ROOT.
MODEL_INFO_FOLDER = "modelinfos"
TEMPORARY = (".restore.", ".tmp")
RESTORE_WRITTEN = declare(
    "restore.written", "checkpoint/startup_artifacts.py: an entry's temporary written, not placed"
)
Member = tuple[tarfile.TarInfo, str]


# The CPU flags that decide which kernels Inductor and oneDNN generate (a kernel built with
# AVX-512 crashes an AVX2-only machine).
CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "fma",
    "f16c",
)


def device_label() -> str:
    """The device compiled code is built for: the GPU's name and architecture, or the CPU's flags."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda sm_{major}{minor} {torch.cuda.get_device_name()}"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return f"cpu {platform.machine()} " + " ".join(flag for flag in CPU_FLAGS if flag in flags)


def enabled() -> bool:
    """Whether start-up artifacts are saved and restored (on unless ``SHARDED_STATE_STARTUP_ARTIFACTS=0``)."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def pack(root: str, folders: list[str]) -> bytes:
    """An uncompressed tar of ``folders`` under ``root``: regular files only, in a stable order."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in folders:
            for current, dirs, files in os.walk(os.path.join(root, folder)):
                dirs[:] = sorted(d for d in dirs if d not in SKIPPED_FOLDERS)
                for name in sorted(files):
                    path = os.path.join(current, name)
                    if name.endswith(".tmp") or not os.path.isfile(path) or os.path.islink(path):
                        continue  # another process's file being written, or not a plain file
                    info = tar.gettarinfo(path, arcname=os.path.relpath(path, root))
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
    return buffer.getvalue()


def write_rank_artifacts(
    target: Store, data: bytes, key: Mapping[str, str], tp_rank: int, pp_rank: int, dp_rank: int = 0
) -> StartupArtifacts:
    """Write one rank's archive into a save's target under a name with the save's token (never a
    published one's), and return its manifest record."""
    name = target.write_rank_file(startup_artifacts_name(tp_rank, pp_rank, dp_rank), data)
    return StartupArtifacts(file=name, size=len(data), sha256=hashlib.sha256(data).hexdigest(), key=dict(key))


def read_rank_artifacts(store: Store, record: StartupArtifacts) -> bytes:
    """The archive's bytes from ``store``, checked against the recorded size and SHA-256."""
    if record.size > MAX_ARCHIVE_BYTES:
        raise CheckpointCorrupt(
            f"{store.file_path(record.file)}: the manifest records {record.size} bytes of start-up artifacts, "
            f"more than the {MAX_ARCHIVE_BYTES} a compile cache takes; the manifest is damaged: save again."
        )
    stored = store.open_part(FileEntry(name=record.file, size=record.size))
    try:
        data = stored.read_at(0, record.size)
    finally:
        stored.close()
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.sha256:
        raise CheckpointCorrupt(
            f"{store.file_path(record.file)}: SHA-256 {digest[:16]}... does not match the manifest's "
            f"{record.sha256[:16]}...; the start-up artifacts are damaged or were replaced. Save the checkpoint "
            "again to carry them."
        )
    return data


# Fields of older keys that no longer decide anything (Inductor names entries by what they compile).
RETIRED_KEY_FIELDS = frozenset({"compilation_config"})


def key_mismatch(saved: Mapping[str, str], served: Mapping[str, str]) -> str | None:
    """None if the keys are equal, else which fields differ and how (for the one log line)."""
    names = sorted((set(saved) | set(served)) - RETIRED_KEY_FIELDS)
    diffs = [
        f"{name}: saved {saved.get(name, '(none)')!r}, served {served.get(name, '(none)')!r}"
        for name in names
        if saved.get(name) != served.get(name)
    ]
    return "; ".join(diffs) if diffs else None


def _member_path(root: str, member: tarfile.TarInfo, in_folder: bool) -> str | None:
    """Where a member goes under ``root``, or None unless it is a plain file inside it (with
    ``in_folder``, inside a top-level folder)."""
    parts = member.name.split("/")
    if not member.isfile() or any(p in ("", ".", "..") for p in parts) or (in_folder and len(parts) < 2):
        return None
    if "\0" in member.name:  # (a PAX path may hold one; no file system name can)
        return None
    path = os.path.normpath(os.path.join(root, member.name))
    return path if path.startswith(os.path.join(os.path.normpath(root), "")) else None


def _checked_members(tar: tarfile.TarFile, size: int, root: str, folders: Collection[str] | None) -> list[Member]:
    """Every member to unpack and where it goes, all checked before a byte is written."""
    chosen: list[Member] = []
    claimed = 0
    try:
        for member in tar:
            if folders is not None and member.name.split("/", 1)[0] not in folders:
                continue
            path = _member_path(root, member, folders is not None)
            if path is None:
                raise CheckpointCorrupt(
                    f"start-up artifacts hold {member.name!r}, which is not a plain file inside the cache folder; "
                    "nothing was unpacked. Save the checkpoint again."
                )
            # A header may claim any size (a sparse member, gigabytes): its bytes must be in the archive.
            if member.offset_data + member.size > size:
                raise CheckpointCorrupt(
                    f"start-up artifacts hold {member.name!r} of {member.size} bytes, past the end of the "
                    f"{size}-byte archive; nothing was unpacked. Save the checkpoint again."
                )
            # Nor may members share bytes: each would write the same tail again.
            claimed += member.size
            if claimed > size:
                raise CheckpointCorrupt(
                    f"start-up artifacts hold members of {claimed} bytes up to {member.name!r}, more than the "
                    f"{size}-byte archive holds; nothing was unpacked. Save the checkpoint again."
                )
            chosen.append((member, path))
    except tarfile.TarError as e:  # a damaged header after the first
        raise _not_an_archive(e) from None
    return chosen


def _not_an_archive(e: tarfile.TarError) -> CheckpointCorrupt:
    return CheckpointCorrupt(
        f"start-up artifacts are not a tar archive ({e}); nothing was unpacked. Save the checkpoint again."
    )


def _open_archive(data: bytes) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=io.BytesIO(data), mode="r:")
    except tarfile.TarError as e:
        raise _not_an_archive(e) from None


def _make_folders(folder: str, made: list[str]) -> None:
    """Create ``folder`` and its missing parents, recording each in ``made`` for :func:`_undo`."""
    missing: list[str] = []
    while folder and not os.path.isdir(folder):  # (a relative root ends in "", the working folder)
        missing.append(folder)
        folder = os.path.dirname(folder)
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):  # a user's file or dangling link: never replaced
                raise
            continue  # a racing restore made it: theirs to keep
        made.append(path)


def _undo(written: list[tuple[str, tuple[int, int]]], made: list[str]) -> None:
    """Remove what a failed restore wrote, only files still its own, then its empty folders."""
    for path, identity in reversed(written):
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) == identity:
                os.remove(path)
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _place_new(temporary: str, path: str) -> bool:
    """Name ``temporary`` ``path`` unless something took that name since: True if placed.
    A hard link never replaces; without hard links, a rename, which would."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        os.replace(temporary, path)
    return True


def restore(data: bytes, root: str, folders: Collection[str] | None = None) -> tuple[int, int]:
    """Unpack a checked archive under ``root``, only the members under ``folders`` (default all).

    Files already there are kept (cache entries are named by their content's hash); new ones are
    written to a temporary and renamed, so vLLM never reads half a file. All or nothing: a failed
    restore removes what it wrote. Returns (files written, files already there)."""
    written: list[tuple[str, tuple[int, int]]] = []
    made: list[str] = []
    swept: set[str] = set()
    kept = 0
    with _open_archive(data) as tar:
        chosen = _checked_members(tar, len(data), root, folders)
        try:
            for member, path in chosen:
                folder = os.path.dirname(path)
                if folder not in swept:  # (what a restore killed mid-write left here: its flock is free)
                    swept.add(folder)
                    remove_dead_temporaries(folder, *TEMPORARY)
                if os.path.lexists(path):
                    kept += 1
                    continue
                _make_folders(folder, made)
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                # Held by flock until placed: a later restore tells a live temporary from a dead one.
                with held_temporary(folder, *TEMPORARY) as (fd, temporary):
                    _write_all(fd, source.read())
                    os.fchmod(fd, 0o644 if not member.mode & 0o111 else 0o755)
                    st = os.fstat(fd)
                    kill_point(RESTORE_WRITTEN)
                    placed = _place_new(temporary, path)
                if not placed:
                    kept += 1
                    continue
                written.append((path, (st.st_dev, st.st_ino)))
        except BaseException as e:
            _undo(written, made)
            if isinstance(e, OSError):
                raise StorageError(
                    f"{root}: cannot unpack start-up artifacts ({e}); what this restore wrote was removed. "
                    "Free space or fix the folder; vLLM compiles as usual meanwhile."
                ) from e
            raise
    return len(written), kept


def sign_checkpoint(store: Store, signer: Signer) -> Manifest:
    """Sign the published checkpoint in ``store`` under the save lock, after checking its start-up
    archives. Returns the signed manifest."""
    require_store(store, "sign_checkpoint")
    store.lock(new_token(), True, ())
    try:
        manifest = store.read_manifest()
        if manifest is None:
            raise CheckpointNotFound(f"{store.where} holds no sharded checkpoint to sign; nothing was written.")
        for entry in manifest.ranks:
            if entry.startup is not None:
                read_rank_artifacts(store, entry.startup)
        signed = signer.sign(manifest)
        store.publish(signed)
        store.clean(signed)
    except BaseException:
        store.abandon([])
        raise
    finally:
        store.close()
    store.release()
    return signed
