"""Offline verification of a whole checkpoint: every check a load makes, for every rank, and every byte."""

from __future__ import annotations

from collections.abc import Callable

from ..format.errors import ShardedStateError, StorageError
from ..format.manifest import FileChecksum, Manifest
from ..format.names import LOCK_NAME, MANIFEST_NAME, parse_file_name, staged_token
from ..planning.manifest_plans import check_saved_geometry
from ..storage.integrity import BlockVerifier
from ..storage.location import Store, StoredFile, no_manifest_here, require_store
from ..storage.progress import ByteProgress
from ..storage.writer import CHUNK_BYTES
from .carry import carried_problems, stale_problems
from .rank_files import check_rank_file
from .startup_artifacts import read_rank_artifacts
from .trust import check_trust


def verify_file_checksum(
    file: StoredFile, checksum: FileChecksum, progress: Callable[[int], None] | None = None
) -> None:
    """Stream a whole open file through its block checksums; raises on the first bad block.
    ``progress(bytes_read_now)`` follows the reads."""
    verifier = BlockVerifier(file.path, checksum)
    position = 0
    while chunk := file.read_at(position, CHUNK_BYTES):
        verifier.update(memoryview(chunk))
        position += len(chunk)
        if progress is not None:
            progress(len(chunk))
    verifier.finish()


def verify_checkpoint(
    store: Store, checksums: bool = True, notes: list[str] | None = None, progress: ByteProgress | None = None
) -> list[str]:
    """Every problem of the checkpoint in ``store``, one line each naming the file; empty when sound.

    Checks what a load checks for every rank (lock, manifest, files, sizes, symlinks, headers)
    and, with ``checksums``, every byte. Also reports parts the manifest does not list, carried
    non-weight files (config, tokenizer) not as recorded, and stale files of the checkpoint it
    replaced that are still there.

    Args:
        store: the checkpoint's location (:func:`..storage.location.open_store` resolves a folder or URL).
        checksums: also read every byte against its block checksums.
        notes: when given, gets one line for each thing that is not the checkpoint's problem: the
            leftovers of a save or engine that died (no load reads them, the next save removes
            them), a damaged or missing start-up archive, unrecorded files beside the parts.
        progress: counts the bytes read for the checksums.

    Returns:
        The problems, one line each naming the file; empty when sound.

    A save that replaces the checkpoint meanwhile makes its parts read as missing: then the new
    checkpoint is verified from the start, once (a note says so).
    """
    require_store(store, "verify_checkpoint")
    notes = [] if notes is None else notes
    manifest_path = store.file_path(MANIFEST_NAME)
    for attempt in range(2):  # the checkpoint read first, then at most the one that replaced it
        seen: list[str] = []
        problems, manifest = _verify_once(store, checksums, seen, progress)
        if not problems or manifest is None or not _replaced(store, manifest):
            if attempt:
                notes.append(
                    f"{manifest_path}: a save replaced the checkpoint while it was being verified (it published "
                    "this manifest and removed the parts of the one read first); the checkpoint verified here is "
                    "the one that replaced it."
                )
            notes += seen
            return list(dict.fromkeys(problems))  # a file found wrong by two checks is listed once
        if progress is not None:
            progress.start_over()
    return [
        f"{manifest_path}: a save replaced the checkpoint while it was being verified, and another replaced that "
        "one while it was verified again; run verify again once no save writes into it."
    ]


def _replaced(store: Store, manifest: Manifest) -> bool:
    """Whether the published manifest is no longer ``manifest``."""
    try:
        return store.read_manifest() != manifest
    except ShardedStateError:
        return True


def _verify_once(
    store: Store, checksums: bool, notes: list[str], progress: ByteProgress | None
) -> tuple[list[str], Manifest | None]:
    """One pass of :func:`verify_checkpoint`: the problems, and the manifest checked."""
    problems: list[str] = []
    try:
        store.check_not_locked()
    except ShardedStateError as e:
        problems.append(str(e))
    try:
        manifest = store.read_manifest()
    except ShardedStateError as e:
        return [*problems, str(e)], None
    if manifest is None:
        return [*problems, f"{no_manifest_here(store)} Nothing to verify."], None
    try:
        check_saved_geometry(manifest)
    except ShardedStateError as e:
        problems.append(str(e))
    listed = set()
    if progress is not None and checksums:
        progress(0, sum(f.size for entry in manifest.ranks for f in entry.files if f.checksum is not None))
    for entry in manifest.ranks:
        for f in entry.files:
            listed.add(f.name)
            try:
                checked = check_rank_file(store, f, entry, "checksum" if checksums else "size")
                with checked.file:
                    if f.checksum is not None and checksums:
                        verify_file_checksum(checked.file, f.checksum, None if progress is None else progress.advance)
            except ShardedStateError as e:
                problems.append(str(e))
    try:
        problems += _beside_the_parts(store, manifest, listed, checksums, notes)
    except StorageError as e:  # a folder this process may not list: what lies beside the parts goes unchecked
        problems.append(str(e))
    return problems, manifest


def _beside_the_parts(
    store: Store, manifest: Manifest, listed: set[str], checksums: bool, notes: list[str]
) -> list[str]:
    """The problems of :func:`_verify_once` outside the listed parts: start-up artifacts, carried and
    stale files, special files, and the folder's other names (leftovers of a save)."""
    if checksums:
        _check_startup_artifacts(store, manifest, notes)
    carried = _check_carried_files(store, manifest, checksums, notes) + stale_problems(store, manifest)
    problems = carried
    # A FIFO beside the parts would hang the serving engine (recorded ones are reported above).
    problems += [str(e) for e in store.special_files() if not any(p.startswith(str(e)) for p in carried)]
    running = store.save_is_running()
    if running:
        # A running save's files are its own to remove or publish.
        return problems
    # A dead save's lock and parts are its leftovers, not the checkpoint's problems. In object
    # storage, whether it still runs cannot be told.
    holder = store.describe_lock()
    locked = holder is not None
    if holder is not None and running is None:
        notes.append(
            f"{store.file_path(LOCK_NAME)}: a save holds the prefix, or died holding it; the published checkpoint "
            "is the one verified here, and parts it does not list are that save's (do not remove them while it runs)."
        )
    elif holder is not None:
        notes.append(
            f"{holder}: the lock of a save that died; the published checkpoint is the one verified here. The next "
            "save (with overwrite) takes it over and removes what it left."
        )
    for name in store.list_names():
        if name not in listed and parse_file_name(manifest.pattern, name) is not None:
            if locked:
                whose = "the save that holds the lock (or died holding it)" if running is None else "the save that died"
                notes.append(
                    f"{store.file_path(name)}: a part that {MANIFEST_NAME} does not list, left by {whose}; our "
                    "loader ignores it, the next save removes it (vLLM's own loader would read it: remove it before "
                    "loading with vLLM's built-in sharded_state)."
                )
                continue
            problems.append(
                f"{store.file_path(name)}: a part that {MANIFEST_NAME} does not list (left by an older "
                "save?); our loader ignores it but vLLM's own loader would read it. Remove it."
            )
        elif (token := staged_token(name)) is not None and not store.owner_is_alive(token):
            # (A live engine's start-up capture is its own, not a leftover, and not noted.)
            notes.append(
                f"{store.file_path(name)}: a staged file or owner marker of a save or engine that is gone "
                "(it never published it); no loader reads it, and the next save into this folder removes it."
            )
    return problems


def _check_carried_files(store: Store, manifest: Manifest, hashed: bool, notes: list[str]) -> list[str]:
    """A problem for each non-weight file the save recorded that the checkpoint no longer holds as saved."""
    if manifest.carried_files is None:
        notes.append(
            f"{store.file_path(MANIFEST_NAME)} records no carried files (a save by an earlier version): the "
            "config, tokenizer and other files beside the parts were not checked. Save the checkpoint again "
            "to record them."
        )
        return []
    # Unrecorded files beside the parts are served all the same.
    beside = [n for n in store.non_weight_files() if n not in manifest.carried_files and n not in manifest.stale_files]
    listed = f"{len(beside)} ({', '.join(beside[:3])}{', ...' if len(beside) > 3 else ''})"
    if beside and not manifest.carried_files:
        notes.append(
            f"{store.file_path(MANIFEST_NAME)} records no carried files, but {listed} lie beside the parts: they "
            "were not checked. A save that copies them from the model (the save script, reshard) records them."
        )
    elif beside:
        notes.append(
            f"{store.file_path(MANIFEST_NAME)}: {listed} beside the parts are not among the files its save "
            "carried, and were not checked; a server of the checkpoint reads them too. If they are not yours, a "
            "save that died before publishing may have left them: remove them."
        )
    return carried_problems(store, manifest.carried_files, hashed)


def _check_startup_artifacts(store: Store, manifest: Manifest, notes: list[str]) -> None:
    """Note bad or untrusted start-up archives: they cost a compile, never a wrong weight."""
    archives = [entry.startup for entry in manifest.ranks if entry.startup is not None]
    if not archives:
        return
    verdict = check_trust(manifest)
    used = "used by a server with these trusted keys" if verdict.trusted else "not used by a server here"
    notes.append(f"start-up artifacts ({len(archives)} archives): {used}: {verdict.reason}.")
    for record in archives:
        try:
            read_rank_artifacts(store, record)
        except ShardedStateError as e:
            notes.append(f"{e} Until then a fresh node serving this rank compiles as without them.")
