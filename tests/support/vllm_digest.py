"""vLLM's names as its source defines them, read off the AST without importing anything.

A module's *digest* is what Python would find in it: its top-level names (a
function with its signature and return type, a class with its bases, members and ``__init__``, a
value with its annotated type, an import as a reference to where it comes from), and the names a
module-level ``__getattr__`` serves (``vllm/__init__.py``'s ``MODULE_ATTRS``, ``vllm/envs.py``'s
``environment_variables``). Types and bases are absolute dotted references, so a chain of
attributes resolves across modules: ``vllm.config.VllmConfig`` -> an instance -> ``model_config``
-> ``vllm.config.model.ModelConfig`` -> ``hf_config``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

# A digest entry: {"kind": "ref", "to": "a.b.C"}, {"kind": "function", "sig": {...}, "returns": ref},
# {"kind": "class", ...}, {"kind": "value", "type": ref}. JSON-ready dictionaries throughout.
Entry = dict[str, Any]


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef, kind: str | None) -> dict[str, Any]:
    """A function's parameters: positional (``pos``), keyword-only, required, ``*args``/``**kwargs``; ``kind``:
    ``staticmethod``, ``classmethod``, ``property`` or None."""
    args = node.args
    positional = [a.arg for a in [*args.posonlyargs, *args.args]]
    return {
        "pos": positional,
        "required": positional[: len(positional) - len(args.defaults)]
        + [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None],
        "kwonly": [a.arg for a in args.kwonlyargs],
        "varargs": args.vararg is not None,
        "varkw": args.kwarg is not None,
        "kind": kind,
    }


class _Namespace:
    """Turns a module's names and annotations into absolute references."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.imported: dict[str, str] = {}
        self.defined: set[str] = set()

    def absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def ref(self, node: ast.expr | None) -> str | None:
        """The absolute name an annotation or base class names; None for builtins, containers, ``Any``."""
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                return self.ref(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
            refs = [r for r in (self.ref(node.left), self.ref(node.right)) if r]
            return refs[0] if len(refs) == 1 else None
        if isinstance(node, ast.Subscript):
            outer = self.ref(node.value)
            if outer in ("typing.Optional", "typing.Annotated", "typing_extensions.Annotated"):
                inner = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
                return self.ref(inner)
            return outer if outer and outer.startswith("vllm.") else None  # Generic[...] bases: the class
        if isinstance(node, ast.Name):
            if node.id in self.imported:
                return self.imported[node.id]
            if node.id in self.defined:
                return f"{self.module}.{node.id}"
            return None
        if isinstance(node, ast.Attribute):
            outer = self.ref(node.value)
            return f"{outer}.{node.attr}" if outer else None
        return None


def _statements(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """A body's statements, with those inside ``if``/``try``/``with`` blocks (``TYPE_CHECKING`` included)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _statements(node.body)
            yield from _statements(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _statements(part)
        elif isinstance(node, ast.With):
            yield from _statements(node.body)
        else:
            yield node


def decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    """The last name of each decorator (``functools.cache`` -> ``cache``, ``config(...)`` -> ``config``)."""
    names = []
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute):
            names.append(target.attr)
        elif isinstance(target, ast.Name):
            names.append(target.id)
    return names


def _value(annotation: ast.expr | None, value: ast.expr | None, ns: _Namespace, parameters: dict[str, str]) -> Entry:
    """A value's entry: its type from its annotation, else from what made it (``X(...)``: an
    instance of class ``X``, or what function ``X`` returns; a parameter: the parameter's annotation)."""
    typed = ns.ref(annotation)
    if typed:
        return {"kind": "value", "type": typed}
    if isinstance(value, ast.Call):
        made_by = ns.ref(value.func)
        if made_by:
            return {"kind": "value", "made_by": made_by}
    if isinstance(value, ast.Name) and value.id in parameters:
        return {"kind": "value", "type": parameters[value.id]}
    return {"kind": "value", "type": None}


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, ns: _Namespace, in_class: bool) -> Entry:
    decorators = decorator_names(node)
    kind = next((k for k in ("staticmethod", "classmethod", "property") if k in decorators), None)
    if kind is None and in_class and ("cached_property" in decorators or "setter" in decorators):
        kind = "property"
    entry: Entry = {"kind": "function", "sig": signature(node, kind if in_class else None)}
    returns = ns.ref(node.returns)
    if returns:
        entry["returns"] = returns
    return entry


def _class(node: ast.ClassDef, ns: _Namespace) -> Entry:
    members: dict[str, Entry] = {}
    fields: list[str] = []
    for stmt in _statements(node.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name not in members or members[stmt.name]["kind"] != "function":
                members[stmt.name] = _function(stmt, ns, in_class=True)
        elif isinstance(stmt, ast.ClassDef):
            members[stmt.name] = _class(stmt, ns)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            annotation = ast.unparse(stmt.annotation)
            if "ClassVar" not in annotation and "InitVar" not in annotation:
                fields.append(stmt.target.id)
            members.setdefault(stmt.target.id, _value(stmt.annotation, stmt.value, ns, {}))
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        members.setdefault(name.id, _value(None, stmt.value if name is target else None, ns, {}))
    # Attributes the methods set on the instance (self.x = ... / self.x: T = ...).
    for method in node.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or not method.args.args:
            continue
        me = method.args.args[0].arg
        parameters = {
            a.arg: typed
            for a in [*method.args.args, *method.args.kwonlyargs]
            if a.annotation is not None and (typed := ns.ref(a.annotation))
        }
        for stmt in ast.walk(method):
            targets: list[tuple[ast.expr, ast.expr | None]] = []
            if isinstance(stmt, ast.Assign):
                targets = [(t, None) for t in stmt.targets]
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                targets = [(stmt.target, getattr(stmt, "annotation", None))]
            for target, annotation in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == me:
                    value = _value(annotation, getattr(stmt, "value", None), ns, parameters)
                    known = members.get(target.attr)
                    if known is None or (known["kind"] == "value" and not known.get("type") and value.get("type")):
                        members[target.attr] = value
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                        members.setdefault(t.attr, {"kind": "value", "type": None})
    decorators = decorator_names(node)
    entry: Entry = {
        "kind": "class",
        "bases": [ns.ref(b) or ast.unparse(b) for b in node.bases],
        "members": members,
    }
    if "dataclass" in decorators or "config" in decorators:
        entry["fields"] = fields
    return entry


def digest(module: str, text: str, is_package: bool) -> Entry:
    """The digest of one module's source (see the module's docstring)."""
    tree = ast.parse(text)
    ns = _Namespace(module, is_package)
    top = list(_statements(tree.body))
    stars: list[str] = []  # from x import *
    for node in top:  # every name first: an annotation may name a class defined further down
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            ns.defined.add(node.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    ns.imported[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    ns.imported[head] = head
        elif isinstance(node, ast.ImportFrom):
            origin = ns.absolute(node)
            for alias in node.names:
                if alias.name == "*":
                    stars.append(origin)
                else:
                    ns.imported[alias.asname or alias.name] = f"{origin}.{alias.name}"
    names: dict[str, Entry] = {name: {"kind": "ref", "to": to} for name, to in ns.imported.items()}
    lazy: dict[str, str | None] = {}
    exported: list[str] | None = None
    for node in top:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, (ast.List, ast.Tuple))
        ):
            exported = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = _function(node, ns, in_class=False)
        elif isinstance(node, ast.ClassDef):
            names[node.name] = _class(node, ns)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.setdefault(node.target.id, _value(node.annotation, node.value, ns, {}))
            if node.value is not None and node.target.id == "environment_variables":
                lazy.update(_lazy_names(node.value, ns))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and (
                        name.id not in names or names[name.id]["kind"] in ("value", "ref")
                    ):
                        names[name.id] = _value(None, node.value if name is target else None, ns, {})
            if any(isinstance(t, ast.Name) and t.id in ("MODULE_ATTRS", "environment_variables") for t in node.targets):
                lazy.update(_lazy_names(node.value, ns))
    result: Entry = {"package": is_package, "names": names}
    if "__getattr__" in names:
        # The names a module-level __getattr__ serves: its table's, or (None) any name at all.
        result["lazy"] = lazy or None
    if stars:
        result["star"] = stars
    if exported is not None:
        result["all"] = exported
    return result


def _lazy_names(value: ast.expr, ns: _Namespace) -> dict[str, str | None]:
    """A ``__getattr__`` table's names: ``MODULE_ATTRS``' ``".module:attr"`` targets as references."""
    found: dict[str, str | None] = {}
    if not isinstance(value, ast.Dict):
        return found
    for key, target in zip(value.keys, value.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        to = None
        if isinstance(target, ast.Constant) and isinstance(target.value, str) and ":" in target.value:
            module, _, attr = target.value.partition(":")
            if module.startswith("."):
                module = ns.package + module
            to = f"{module}.{attr}"
        found[key.value] = to
    return found
