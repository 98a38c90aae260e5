"""Object stores in the tests: settings pointed at an emulator, a save to and a load from a bucket,
tensors that fail part-way through a save; and the backends a store-level test runs on (a local
folder, the in-process ``memory://``), with what the test does behind the store's back there.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path

import obstore
import torch

from tests.support.checkpoints import source_of, stage_state
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, ReadOptions, load_rank, read_manifest
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.storage import in_memory, objects
from vllm_sharded_loader.storage.location import open_store


@contextlib.contextmanager
def stores_pointed_at(environment: dict[str, str]):
    """Set ``environment`` for every object-store client of this process (the cached stores are
    rebuilt), and put the previous settings back on exit."""
    saved = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    objects._store.cache_clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        objects._store.cache_clear()


@contextlib.contextmanager
def bucket_on(server, bucket: str):
    """A server (the session's SeaweedFS) with ``bucket`` made, and this process's clients pointed at it."""
    with stores_pointed_at(server.aws_environment()):
        server.create_bucket(bucket)
        yield server


def save_to_bucket(url, model, tp_size, pp_size=1, max_size=4096):
    ranks = {
        RankInfo(t, tp_size, p, pp_size): stage_state(model, tp_size, pp_size, t, p)
        for p in range(pp_size)
        for t in range(tp_size)
    }
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    return save_checkpoint(
        url, ranks, dtype="int32", source=source_of(model), options=SaveOptions(max_size=max_size, geometry=geometry)
    )


def load_from(url, model, tp_size, tp_rank=0, pp_size=1, pp_rank=0, **kw):
    expected = stage_state(model, tp_size, pp_size, tp_rank, pp_rank)
    targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
    options = ReadOptions(**{k: kw.pop(k) for k in list(kw) if k in ReadOptions.__dataclass_fields__})
    request = LoadRequest(open_store(url), read_manifest(url), serving=source_of(model), **kw)
    stats = load_rank(request, targets, RankInfo(tp_rank, tp_size, pp_rank, pp_size), options)
    return stats, targets, expected


class Failing(dict):
    """Tensors of which the fourth cannot be produced (as when an offline reshard's read fails): the
    save fails part-way, after uploads began."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.served = 0

    def __getitem__(self, name):
        self.served += 1
        if self.served > 3:
            raise OSError(28, "No space left on device")  # what a full staging disk raises
        return super().__getitem__(name)


def overwrite_at_tp1(url, model):
    """``model`` saved at TP=1 over whatever ``url`` holds."""
    ranks = {RankInfo(0, 1): stage_state(model, 1, 1, 0, 0)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    return save_checkpoint(
        url,
        ranks,
        dtype="int32",
        source=source_of(model),
        options=SaveOptions(max_size=4096, geometry=geometry, overwrite=True),
    )


def overwrite_at_tp2(url, model, max_size: int | None = 4096):
    """``model`` saved at TP=2, without geometry, over whatever ``url`` holds."""
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    return save_checkpoint(
        url, ranks, dtype="int32", source=source_of(model), options=SaveOptions(max_size=max_size, overwrite=True)
    )


@contextlib.contextmanager
def proxied(server, endpoint_variable: str, mode: str, limit: int = 0, match: bytes = b"", **settings: str):
    """Point every object-store client of this process (through ``endpoint_variable``, the variable
    naming its endpoint) at a fault proxy (tests/support/faultproxy.py) in front of ``server``."""
    from tests.support.faultproxy import FaultProxy

    port = int(server.endpoint.rsplit(":", 1)[1])
    with (
        FaultProxy(port, mode, limit, match=match) as proxy,
        stores_pointed_at({endpoint_variable: proxy.url, **settings}),
    ):
        yield proxy


class InMemory:
    """The in-process ``memory://`` buckets as a server of the object-store tests: written and read
    behind the loader's back through their own client."""

    def create_bucket(self, bucket: str) -> None:
        pass  # (a bucket is made on first use)

    def environment(self) -> dict[str, str]:
        return {}

    def upload(self, bucket: str, key: str, data: bytes) -> None:
        obstore.put(in_memory.bucket(bucket), key, data)

    def download(self, bucket: str, key: str) -> bytes:
        return bytes(obstore.get(in_memory.bucket(bucket), key).bytes())

    def keys(self, bucket: str, prefix: str) -> list[str]:
        return sorted(o["path"] for batch in obstore.list(in_memory.bucket(bucket), prefix or None) for o in batch)


class Backend:
    """Where a store-level test saves (``local``: a folder under ``tmp_path``; ``memory``: a prefix of an
    in-process bucket), and its files as the test sees them, behind the store's back."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind, self.tmp_path = kind, tmp_path
        self.bucket = f"test-{uuid.uuid4().hex[:8]}"

    def location(self, name: str) -> str:
        return str(self.tmp_path / name) if self.kind == "local" else f"memory://{self.bucket}/{name}"

    def files(self, where: str) -> dict[str, str]:
        """Every file under ``where``, by relative name: its SHA-256 (a folder's empty subfolders as "dir")."""
        if self.kind == "local":
            root = Path(where)
            if not root.exists():
                return {}
            return {
                str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
                for p in sorted(root.rglob("*"))
            }
        prefix = objects.ObjectPrefix.parse(where).prefix
        memory = InMemory()
        return {
            k[len(prefix) :]: hashlib.sha256(memory.download(self.bucket, k)).hexdigest()
            for k in memory.keys(self.bucket, prefix)
        }

    def everything(self) -> dict[str, str]:
        """:meth:`files` of the whole test folder, or of the whole bucket."""
        return self.files(str(self.tmp_path) if self.kind == "local" else f"memory://{self.bucket}")

    def names(self, where: str) -> set[str]:
        """The names directly under ``where``."""
        return {name.split("/")[0] for name in self.files(where)}

    def put(self, where: str, name: str, data: bytes) -> None:
        if self.kind == "local":
            Path(where, name).write_bytes(data)
        else:
            InMemory().upload(self.bucket, objects.ObjectPrefix.parse(where).key(name), data)
