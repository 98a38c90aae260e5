"""Loading a checkpoint saved at another TP/PP size: planned reads of exactly the bytes a rank keeps
(:class:`ReshardSource`, which the offline ``vllm-sharded reshard`` uses too)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from ..format.errors import CheckpointMismatch, listing
from ..format.manifest import Manifest
from ..planning.manifest_plans import files_to_check, plan_manifest_reads, unexpected_tensors
from ..planning.reads import ReadPlan, TensorPlan
from ..planning.topology import RankInfo
from ..storage.location import Store, StoredFile
from ..storage.lowering import read_plans
from ..storage.reader import DEFAULT_READ, ReadOptions, ReadStats
from ..storage.tensors import torch_dtype
from .rank_files import CheckedFile, HeldAdoption, check_not_replaced, check_rank_file
from .request import LoadRequest
from .stats import LoadStats, check_verify_mode


class ReshardSource:
    """A checkpoint opened for planned reads at another topology: each file is checked the first time
    a plan touches it; with ``verify="checksum"`` every block a read touches is verified."""

    def __init__(self, store: Store, manifest: Manifest, verify: str = "size") -> None:
        self.store, self.manifest, self.verify = store, manifest, check_verify_mode(verify)
        self.dtypes = {name: t.dtype for entry in manifest.ranks for name, t in entry.tensors.items()}
        self.owners = {f.name: (f, entry) for entry in manifest.ranks for f in entry.files}
        self.checked: dict[str, CheckedFile] = {}

    def plan(self, needed: Sequence[str], rank: RankInfo, tied: Sequence[Sequence[str]] = ()) -> ReadPlan:
        """The :class:`~..planning.reads.ReadPlan` giving ``rank`` the tensors ``needed``."""
        return plan_manifest_reads(self.manifest, needed, rank, tied=tied, directory=self.store.where)

    def stored_dtype(self, tensor_plan: TensorPlan) -> torch.dtype:
        return torch_dtype(self.dtypes[tensor_plan.source_name], tensor_plan.name)

    def check_file(self, name: str) -> StoredFile:
        """Open and check a saved file the first time a plan touches it."""
        if name not in self.checked:
            f, entry = self.owners[name]
            self.checked[name] = check_rank_file(self.store, f, entry, self.verify)
        return self.checked[name].file

    def check_unchanged(self) -> None:
        """Raise if a file read was replaced or modified since it was opened."""
        for checked in self.checked.values():
            checked.file.check_unchanged()

    def read(
        self,
        plans: Mapping[str, TensorPlan],
        targets: Mapping[str, torch.Tensor],
        options: ReadOptions = DEFAULT_READ,
        adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
    ) -> ReadStats:
        """Fill ``targets`` from their plans (cast if the saved dtype differs); ``options`` and ``adopt``
        as for :func:`.load.load_rank`."""
        files = sorted({r.file for p in plans.values() for r in p.reads})
        checksums = {n: self.owners[n][0].checksum for n in files} if self.verify == "checksum" else None
        return read_plans(
            {name: self.check_file(name) for name in files},
            plans,
            targets,
            {name: self.stored_dtype(p) for name, p in plans.items()},
            checksums=checksums,
            options=options,
            adopt=adopt,
        )

    def fill(self, tensor_plan: TensorPlan, target: torch.Tensor) -> None:
        """Read one planned tensor into ``target`` (cast if its dtype differs from the saved one)."""
        self.read({tensor_plan.name: tensor_plan}, {tensor_plan.name: target})

    def close(self) -> None:
        for checked in self.checked.values():
            checked.file.close()
        self.checked.clear()

    def __enter__(self) -> ReshardSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_resharded(
    request: LoadRequest,
    targets: Mapping[str, torch.Tensor],
    rank: RankInfo,
    options: ReadOptions = DEFAULT_READ,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
    started: float | None = None,
) -> LoadStats:
    """Fill a rank's tensors from a checkpoint saved at another TP/PP size.

    Plans exactly the byte ranges this rank keeps and checks every planned shape and file before
    reading them into the parameters (or mapping them where ``adopt`` offers).
    """
    started = time.perf_counter() if started is None else started
    store, manifest, tied = request.store, request.manifest, request.tied
    directory = store.where
    assert manifest is not None, "a resharding load has a manifest"
    with ReshardSource(store, manifest, request.verify) as source:
        plan = source.plan(list(targets), rank, tied)
        wrong = [
            f"{n} planned {list(p.shape)} but the model expects {list(targets[n].shape)}"
            for n, p in plan.tensors.items()
            if tuple(p.shape) != tuple(targets[n].shape)
        ]
        if wrong:
            raise CheckpointMismatch(
                f"{directory} ({rank}, resharded from TP={manifest.tp_size} PP={manifest.pp_size}): shape "
                f"mismatch: {'; '.join(wrong[:5])}. Save the checkpoint again."
            )
        unexpected = unexpected_tensors(manifest, targets, tied, rank.pp_size)
        if unexpected:
            shown = listing(unexpected, 5)
            raise CheckpointMismatch(
                f"{directory} ({rank}, resharded from TP={manifest.tp_size} PP={manifest.pp_size}): the checkpoint "
                f"holds tensors the served model does not have: {shown}. It was saved from another model: save it "
                "again from the model being served."
            )
        for name in files_to_check(plan, manifest):
            source.check_file(name)  # every check before the first byte lands in a parameter
        held = HeldAdoption(adopt)
        read = source.read(plan.tensors, targets, options, held.callbacks())
        check_not_replaced(store, manifest, source.check_unchanged)
        held.hand_over()
        cast = [n for n, p in plan.tensors.items() if targets[n].dtype != source.stored_dtype(p)]
    return LoadStats(
        files=tuple(store.file_path(n) for n in plan.files),
        tensors=len(plan.tensors),
        bytes_read=plan.bytes_read,
        seconds=time.perf_counter() - started,
        cast=tuple(cast),
        with_manifest=True,
        resharded_from=(manifest.tp_size, manifest.pp_size),
        checkpoint_bytes=manifest.nbytes,
        threads=read.threads,
    )
