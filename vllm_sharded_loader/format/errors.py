"""The package's error types, and how their messages list things. Each subclass of
:class:`ShardedStateError` names one thing that went wrong, so that callers branch on the type."""

from __future__ import annotations

from collections.abc import Sequence


class ShardedStateError(ValueError):
    """A sharded checkpoint cannot be saved or loaded as asked.

    The message names the file or tensor, what was expected, what was found, and
    what to do. A ``ValueError`` so that vLLM reports it like its own loader errors.
    """

    #: Raised because another worker failed, after the workers exchanged their outcomes.
    agreed: bool = False
    #: The failing worker's own error, where an agreed error carries it.
    origin: BaseException | None = None


class CheckpointNotFound(ShardedStateError):
    """No checkpoint, file, object or manifest where one was asked for."""


class CheckpointLocked(ShardedStateError):
    """A live save holds the checkpoint's lock."""


class CheckpointMismatch(ShardedStateError):
    """A sound checkpoint that does not fit the served model, topology, dtype or options."""


class CheckpointCorrupt(ShardedStateError):
    """A file is truncated, replaced, hostile, of the wrong kind, or fails its checksum."""


class SaveRefused(ShardedStateError):
    """A save refused before its publish: the checkpoint and the engine are as they were."""


class ConvertRefused(SaveRefused):
    """A source ``convert`` cannot turn into a checkpoint without running the model; nothing was written."""


class RankStopped(ShardedStateError):
    """A ``convert`` rank stopped because another rank's conversion failed (that failure is reported)."""


class SaveFailedAfterPublish(ShardedStateError):
    """The manifest was published (the new checkpoint is complete), but a later step failed."""


class InterruptedAfterPublish(KeyboardInterrupt):
    """An interrupt after the manifest at ``where`` was published: the new checkpoint is complete; its
    lock and the parts it replaced remain for the next save with overwrite to remove."""

    def __init__(self, where: str, store: object = None) -> None:
        super().__init__(where)
        self.where, self.store = where, store  # (the store the save published into, where known)


class WorkerLost(ShardedStateError):
    """Another worker of the same load, save or update stopped answering (or a replica never joined it)."""


class InvalidKey(ShardedStateError):
    """A signing or trusted key file that is missing, encrypted, or not a PEM key of a supported kind."""


class InvalidOption(ShardedStateError):
    """An argument, option, file pattern, URL or environment setting that is not valid; nothing was read or written."""


class Unsupported(ShardedStateError):
    """What this version, this vLLM or this machine does not support: a missing package, a layer or placement it
    does not know."""


class StorageError(ShardedStateError):
    """The storage failed under a read, write or removal: an I/O or network error, or a request the store refused."""


def agreed_error(cls: type[ShardedStateError], message: str, origin: BaseException | None = None) -> ShardedStateError:
    """An error of type ``cls`` raised because another worker failed.

    >>> e = agreed_error(SaveRefused, "rank 1 failed")
    >>> (type(e).__name__, e.agreed, isinstance(e, ShardedStateError))
    ('SaveRefused', True, True)
    """
    error = cls(message)
    error.agreed = True
    error.origin = origin
    return error


def listing(items: Sequence[str], limit: int = 10, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` for a message, and how many there are in all.

    >>> listing(["a", "b", "c"], limit=2)
    'a, b, ... (3 in all)'
    """
    shown = sep.join(items[:limit])
    return shown + (f"{sep}... ({len(items)} in all)" if len(items) > limit else "")
