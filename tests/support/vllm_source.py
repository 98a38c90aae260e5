"""One vLLM version's source, digested on demand (:mod:`.vllm_digest`): a folder, a wheel, or a surface file.

A folder (an installed vLLM's site-packages) and a wheel (its ``vllm/*.py`` read from the archive,
nothing installed or imported) answer every question. A *surface* file answers only the questions
recorded when it was made from the wheel (:meth:`Source.surface_of`): every module, name and
member that resolving the package's uses looked up, each with what the wheel said, an absence
included. A question it has no answer for raises :class:`NotCovered`: the package uses something
new, and the surface must be made again from the wheel (``scripts/vllm_surface.py``).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.vllm_digest import Entry, digest

ABSENT: Entry = {"kind": "absent"}  # a surface's record of a name the wheel does not have
# The digests' mappings of names, whose lookups a surface records one by one.
NAME_MAPPINGS = ("names", "members", "lazy")


class NotCovered(Exception):
    """A surface file has no answer for a question: made for the package's earlier uses, it must be made again."""


class _Recorded(dict):
    """A mapping of names that remembers which were asked for (``in``, ``get``, ``[]``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.asked: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.asked.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def __getitem__(self, key: Any) -> Any:
        self.asked.add(key)
        return super().__getitem__(key)


class _Surfaced(dict):
    """A surface's mapping of names: a name it never recorded is a question it cannot answer."""

    def __init__(self, *args: Any, where: str = "") -> None:
        super().__init__(*args)
        self.where = where

    def _answer(self, key: Any) -> Any:
        if not super().__contains__(key):
            raise NotCovered(f"{self.where}: {key!r} was never looked up when this surface was made")
        value = super().__getitem__(key)
        return None if value == ABSENT else value

    def get(self, key: Any, default: Any = None) -> Any:
        value = self._answer(key)
        return default if value is None else value

    def __contains__(self, key: object) -> bool:
        return self._answer(key) is not None

    def __getitem__(self, key: Any) -> Any:
        value = self._answer(key)
        if value is None:
            raise KeyError(key)
        return value


def _wrap(entry: Any, mapping: type, where: str) -> Any:
    """``entry`` with its mappings of names (recursively) made ``mapping``."""
    if not isinstance(entry, dict):
        return entry
    wrapped = {}
    for key, value in entry.items():
        if key in NAME_MAPPINGS and isinstance(value, dict):
            inner = {k: _wrap(v, mapping, f"{where}.{k}") for k, v in value.items()}
            wrapped[key] = mapping(inner, where=where) if mapping is _Surfaced else mapping(inner)
        else:
            wrapped[key] = _wrap(value, mapping, where) if key not in ("sig",) else value
    return wrapped


def _pruned(entry: Any) -> Any:
    """A recorded entry, its mappings of names cut to what was asked (an unasked entry's own mappings go
    too), with :data:`ABSENT` for each name asked for and missing."""
    if not isinstance(entry, dict):
        return entry
    kept = {}
    for key, value in entry.items():
        if isinstance(value, _Recorded):
            kept[key] = {n: _pruned(value[n]) if dict.__contains__(value, n) else ABSENT for n in sorted(value.asked)}
        else:
            kept[key] = _pruned(value)
    return kept


class Source:
    """One vLLM version's modules, by dotted name, as digests."""

    def __init__(
        self, version: str, read: Callable[[str], str | None], modules: set[str] | None, record: bool = False
    ) -> None:
        self.version = version
        self._read = read  # "vllm/config/__init__.py" -> its text, or None
        self._modules = modules  # every module's name, where known without reading (a wheel)
        self._digests: dict[str, Entry | None] = {}
        self._record = record
        self.asked_modules: dict[str, bool] = {}  # what is_module answered: recorded into a surface
        self.surface: dict[str, Any] | None = None  # a surface file's own fields (wheel, sha256), if one

    @classmethod
    def folder(cls, root: str | Path, version: str) -> Source:
        """The source under ``root`` (the folder that holds ``vllm/``: site-packages for an installed vLLM)."""
        base = Path(root)

        def read(path: str) -> str | None:
            file = base / path
            return file.read_text() if file.is_file() else None

        return cls(version, read, None)

    @classmethod
    def wheel(cls, path: str | Path, record: bool = False) -> Source:
        """A wheel's ``vllm/`` sources, read from the archive; ``record``: to make a surface of it."""
        archive = zipfile.ZipFile(path)
        files = {n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")}

        def read(name: str) -> str | None:
            return archive.read(name).decode() if name in files else None

        modules = set()
        for file in files:
            parts = file[: -len(".py")].split("/")
            if parts[-1] == "__init__":
                parts.pop()
            modules.add(".".join(parts))
        return cls(Path(path).name.split("-")[1], read, modules, record)

    @classmethod
    def surface_file(cls, path: str | Path) -> Source:
        """A surface file written by :meth:`surface_of`."""
        data = json.loads(Path(path).read_text())
        source = cls(data["version"], lambda name: None, None)
        source.surface = {k: v for k, v in data.items() if k not in ("modules", "digests")}
        source.asked_modules = _Surfaced(data["modules"], where=f"{Path(path).name}: is it a module")
        source._digests = _Surfaced(
            {name: _wrap(d, _Surfaced, f"{Path(path).name}: {name}") for name, d in data["digests"].items()},
            where=f"{Path(path).name}: its modules",
        )
        return source

    def module(self, name: str) -> Entry | None:
        """The digest of module ``name``; None if this version has no such module."""
        if self.surface is not None:
            return self._digests[name] if self.is_module(name) else None
        if name not in self._digests:
            found = None
            if self._modules is None or name in self._modules:
                path = name.replace(".", "/")
                for file, package in ((f"{path}/__init__.py", True), (f"{path}.py", False)):
                    text = self._read(file)
                    if text is not None:
                        found = digest(name, text, package)
                        break
            self._digests[name] = _wrap(found, _Recorded, name) if self._record and found else found
            self.asked_modules[name] = found is not None
        return self._digests[name]

    def is_module(self, name: str) -> bool:
        if self.surface is not None:
            return bool(self.asked_modules[name])
        found = name in self._modules if self._modules is not None else self.module(name) is not None
        self.asked_modules[name] = found
        return found

    def surface_of(self, distribution: str, wheel: str, sha256: str) -> dict[str, Any]:
        """What the resolutions so far asked of this (recording) source, and its answers: a surface file's content."""
        assert self._record, "a surface is made from a source opened with record=True"
        return {
            "distribution": distribution,
            "version": self.version,
            "wheel": wheel,
            "sha256": sha256,
            "modules": dict(sorted(self.asked_modules.items())),
            "digests": {name: _pruned(d) for name, d in sorted(self._digests.items()) if d is not None},
        }
