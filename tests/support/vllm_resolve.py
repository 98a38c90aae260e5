"""Resolving a chain of steps (an attribute, an instance, a call with its arguments' shape) against one
vLLM version's source (:class:`.vllm_source.Source`), saying at which step and why it breaks.

A chain starts at a top-level module and follows what each step reaches: a module's names (its
submodules, its ``from x import *``, the names its ``__getattr__`` serves), a class's members
through its vLLM bases, what an attribute's annotated type or the call that made it says it
holds, what a function's annotated return type says it returns. A call is checked against the
signature (the number of positional arguments, each keyword, the required parameters). Where the
source says no more (a name from outside vLLM, a value of no named type), the chain's check ends
there, the steps before it checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.support.vllm_digest import Entry
from tests.support.vllm_source import Source

# How many references a resolution may follow (an import cycle would otherwise never end).
MAX_HOPS = 60
INSTANCE = "()"  # a chain step: an instance of the class before it (a parameter annotated with the class)


@dataclass(frozen=True)
class Call:
    """One call in a chain: how many positional arguments, which keywords, and whether ``*``/``**`` hide more."""

    positional: int
    keywords: tuple[str, ...] = ()
    starred: bool = False


Step = str | Call


class Broken(Exception):
    """A chain does not resolve in a version: the message says at which step and why."""


class Unknown:
    """Where a chain's check ends: the source tells nothing about what the steps before reached."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"<{self.why}>"


UNKNOWN = Unknown("outside vLLM, or a name served by a __getattr__ without a table")
UNTYPED = Unknown("exists, of a type the source does not name")


@dataclass(frozen=True, eq=False)
class _Module:
    name: str


@dataclass(frozen=True, eq=False)
class _Class:
    name: str
    entry: Entry
    instance: bool = False


@dataclass(frozen=True, eq=False)
class _Function:
    name: str
    entry: Entry
    bound: bool = False


def shown(steps: tuple[Step, ...]) -> str:
    """A chain as the package writes it: ``vllm.distributed.get_tp_group().world_size``."""
    text = str(steps[0])
    for step in steps[1:]:
        text += "()" if isinstance(step, Call) or step == INSTANCE else f".{step}"
    return text


class Resolver:
    """Resolves chains against one :class:`Source`."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def chain(self, steps: tuple[Step, ...]) -> Any:
        """What ``steps`` reach; raises :class:`Broken` where they break."""
        head = steps[0]
        assert isinstance(head, str)
        if self.source.module(head) is None:
            raise Broken(f"no module {head}")
        where: Any = _Module(head)
        for index, step in enumerate(steps[1:], start=1):
            where = self.step(where, step, shown(steps[:index]), 0)
        return where

    def ref(self, dotted: str, hops: int) -> Any:
        """What an absolute reference of a digest names: a module, a class, a function, or unknown."""
        parts = dotted.split(".")
        if hops > MAX_HOPS or parts[0] != "vllm":
            return UNKNOWN
        for cut in range(len(parts), 0, -1):
            name = ".".join(parts[:cut])
            if self.source.is_module(name):
                where: Any = _Module(name)
                for attr in parts[cut:]:
                    where = self.step(where, attr, name, hops + 1)
                    name += f".{attr}"
                return where
        return UNKNOWN

    def step(self, where: Any, step: Step, before: str, hops: int) -> Any:
        if isinstance(where, Unknown):
            return where
        if isinstance(step, Call):
            return self.call(where, step, before, hops)
        if step == INSTANCE:
            return _Class(where.name, where.entry, instance=True) if isinstance(where, _Class) else UNKNOWN
        if isinstance(where, _Module):
            return self.module_attribute(where.name, step, hops)
        if isinstance(where, _Class):
            return self.class_attribute(where, step, before, hops)
        return UNKNOWN  # a function's attributes (__code__, __wrapped__): Python's own

    def module_attribute(self, module: str, attr: str, hops: int) -> Any:
        entry = self.source.module(module)
        assert entry is not None
        found = entry["names"].get(attr)
        if found is not None:
            return self.entry(f"{module}.{attr}", found, hops, instance=False)
        if self.source.is_module(f"{module}.{attr}"):
            return _Module(f"{module}.{attr}")
        for origin in entry.get("star", []):
            star = self.source.module(origin) if origin.startswith("vllm.") else None
            if star is None:
                continue
            exported = star.get("all")
            if attr in exported if exported is not None else (not attr.startswith("_") and attr in star["names"]):
                return self.module_attribute(origin, attr, hops + 1)
        if "lazy" in entry:  # a module-level __getattr__
            if entry["lazy"] is None:
                return UNKNOWN
            if attr in entry["lazy"]:
                target = entry["lazy"][attr]
                return self.ref(target, hops + 1) if target else UNTYPED
        if attr.startswith("__") and attr.endswith("__"):
            return UNKNOWN  # __file__, __version__ of a package without one, ...
        raise Broken(f"module {module} has no attribute {attr!r}")

    def entry(self, name: str, entry: Entry, hops: int, instance: bool) -> Any:
        kind = entry["kind"]
        if kind == "ref":
            return self.ref(entry["to"], hops + 1)
        if kind == "class":
            return _Class(name, entry)
        if kind == "function":
            sig_kind = entry["sig"]["kind"]
            if sig_kind == "property":
                return self.instance_of(entry.get("returns"), hops) if instance else UNTYPED
            return _Function(name, entry, sig_kind == "classmethod" or (instance and sig_kind != "staticmethod"))
        if entry.get("made_by"):
            made_by = self.ref(entry["made_by"], hops + 1)
            if isinstance(made_by, _Class) and not made_by.instance:
                return _Class(made_by.name, made_by.entry, instance=True)
            if isinstance(made_by, _Function):
                return self.instance_of(made_by.entry.get("returns"), hops)
            return UNTYPED
        return self.instance_of(entry.get("type"), hops)

    def instance_of(self, ref: str | None, hops: int) -> Any:
        found = self.ref(ref, hops + 1) if ref else UNTYPED
        return _Class(found.name, found.entry, instance=True) if isinstance(found, _Class) else UNTYPED

    def mro(self, cls: _Class, hops: int) -> tuple[list[tuple[str, Entry]], bool]:
        """The class and its vLLM bases, breadth first; and whether it is open (a base outside vLLM,
        or a ``__getattr__``): a name none of them has may still exist."""
        found: list[tuple[str, Entry]] = []
        open_, queue, seen = False, [(cls.name, cls.entry)], set()
        while queue and len(seen) < MAX_HOPS:
            name, entry = queue.pop(0)
            if name in seen:
                continue
            seen.add(name)
            found.append((name, entry))
            members = entry["members"]
            open_ = open_ or "__getattr__" in members or "__getattribute__" in members
            for base in entry["bases"]:
                resolved = self.ref(base, hops + 1) if base.startswith("vllm.") else UNKNOWN
                if isinstance(resolved, _Class):
                    queue.append((resolved.name, resolved.entry))
                elif base not in ("object", "ABC", "abc.ABC", "typing.Generic", "typing.Protocol"):
                    open_ = True
        return found, open_

    def class_attribute(self, cls: _Class, attr: str, before: str, hops: int) -> Any:
        classes, open_ = self.mro(cls, hops)
        for name, entry in classes:
            if attr in entry["members"]:
                return self.entry(f"{name}.{attr}", entry["members"][attr], hops, instance=cls.instance)
        if open_ or (attr.startswith("__") and attr.endswith("__")):
            return UNKNOWN
        raise Broken(f"{before} ({cls.name}) has no attribute {attr!r}")

    def call(self, where: Any, call: Call, before: str, hops: int) -> Any:
        if isinstance(where, _Function):
            check_call(where.entry["sig"], call, where.bound, before)
            return self.instance_of(where.entry.get("returns"), hops)
        if not isinstance(where, _Class):
            return UNTYPED
        classes, open_ = self.mro(where, hops)
        method = "__call__" if where.instance else "__init__"
        found = next((e["members"][method] for _, e in classes if method in e["members"]), None)
        if found is not None and found["kind"] == "function":
            check_call(found["sig"], call, True, before)
        elif not where.instance and not open_ and any("fields" in e for _, e in classes):
            fields = [f for _, e in reversed(classes) for f in e.get("fields", [])]
            check_call(
                {"pos": fields, "required": [], "kwonly": [], "varargs": False, "varkw": False}, call, False, before
            )
        if where.instance:
            return self.instance_of(found.get("returns"), hops) if found else UNTYPED
        return _Class(where.name, where.entry, instance=True)


def check_call(sig: dict[str, Any], call: Call, bound: bool, before: str) -> None:
    """Raise :class:`Broken` if a call of this shape does not fit the signature."""
    positional = sig["pos"][1:] if bound else sig["pos"]
    required = [r for r in sig["required"] if not (bound and sig["pos"] and r == sig["pos"][0])]
    if call.positional > len(positional) and not sig["varargs"]:
        raise Broken(
            f"{before}(): takes {len(positional)} positional arguments ({', '.join(positional)}), "
            f"given {call.positional}"
        )
    accepted = set(positional[call.positional :]) | set(sig["kwonly"])
    unknown = [k for k in call.keywords if k not in accepted]
    if unknown and not sig["varkw"]:
        raise Broken(
            f"{before}(): no parameter {', '.join(map(repr, unknown))} (takes {', '.join(positional + sig['kwonly'])})"
        )
    given = set(positional[: call.positional]) | set(call.keywords)
    missing = [r for r in required if r not in given]
    if missing and not call.starred:
        raise Broken(f"{before}(): the required {', '.join(map(repr, missing))} is not passed")


def check_override(base: Any, ours: dict[str, Any], where: str) -> None:
    """Raise :class:`Broken` if our method cannot take each call vLLM makes to the method it overrides:
    every parameter of theirs, by position and by name; none required that they do not pass."""
    if not isinstance(base, _Function):
        raise Broken(f"{where} overrides {getattr(base, 'name', base)}, which is not a method")
    theirs = base.entry["sig"]
    their_pos = theirs["pos"] if theirs["kind"] == "staticmethod" else theirs["pos"][1:]
    our_pos = ours["pos"] if ours["kind"] == "staticmethod" else ours["pos"][1:]
    for index, name in enumerate(their_pos):
        if index >= len(our_pos):
            if not ours["varargs"]:
                raise Broken(f"{where}: vLLM's {base.name} takes {name!r} at position {index + 1}; ours does not")
        elif our_pos[index] != name and not ours["varkw"]:
            raise Broken(f"{where}: vLLM's {base.name} names parameter {index + 1} {name!r}, ours {our_pos[index]!r}")
    for name in theirs["kwonly"]:
        if name not in our_pos and name not in ours["kwonly"] and not ours["varkw"]:
            raise Broken(f"{where}: vLLM's {base.name} takes the keyword {name!r}; ours does not")
    ours_required = [r for r in ours["required"] if r in our_pos or r in ours["kwonly"]]
    extra = [r for r in ours_required if r not in their_pos and r not in theirs["kwonly"]]
    if extra:
        raise Broken(f"{where}: requires {', '.join(map(repr, extra))}, which vLLM's {base.name} does not take")
