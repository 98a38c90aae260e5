"""Every vLLM name the package uses, read from its source (``ast``), as chains that
:mod:`tests.support.vllm_resolve` resolves against each vLLM version.

A use is a chain of steps from a top-level module: ``vllm.config.load.LoadConfig`` (an import),
``vllm.envs.VLLM_CACHE_ROOT`` (an attribute of an imported module),
``vllm.distributed.get_tp_group().world_size`` (a call, with the shape of its arguments, then an
attribute of what the function's annotated return type says it returns). The chain follows the
package's names for vLLM objects:

- a name imported from vLLM, at module or function level (``TYPE_CHECKING`` imports too);
- a local name assigned from a vLLM chain (``verify = config.VllmConfig.try_verify_and_update_config``),
  or from a module-level function of the same file that returns one (``layerwise = _layerwise()``);
- a parameter annotated with a vLLM class (``model_config: ModelConfig``): an instance of it;
- a parameter that receives a vLLM module: a hook given to ``after_import("vllm.x", hook)``, and
  the module-level functions of the same file it passes that module on to;
- ``self.x`` and ``super().x`` in a class that derives from a vLLM class, where ``x`` is not the
  class's own; and each public method of such a class, which must take vLLM's calls to the
  method it overrides (``override``);
- a string constant that names a vLLM module (``"vllm.model_executor.model_loader"``).

Imports in ``try: ... except ImportError:`` are alternatives, as Python takes them: the first
whose import resolves in a version is the one the uses through its names are checked against there.

What the package reaches through ``getattr(obj, "name", default)`` or ``hasattr`` is left out on
purpose (those uses tolerate the name's absence), and so is what it reaches through an untyped value.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.vllm_digest import decorator_names, signature
from tests.support.vllm_resolve import INSTANCE, Call, Step, shown

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_sharded_loader"
MODULE_NAME = re.compile(r"^vllm(\.[A-Za-z_][A-Za-z0-9_]*)+$")
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}
# Methods every class has, whose "override" says nothing about vLLM.
INHERITED = frozenset({"__init_subclass__", "__repr__", "__str__", "__eq__", "__hash__", "__post_init__"})
BLOCKS = ("body", "orelse", "finalbody", "handlers")

Chain = tuple[Step, ...]
# One way a name reaches vLLM: (the import that must resolve for Python to take this way, or None; the chain).
Binding = tuple[Chain | None, Chain]
SELF: tuple[Binding, ...] = ((None, ("self",)),)  # a method's instance in a class deriving from vLLM's


@dataclass(frozen=True)
class Use:
    """One chain the package relies on, and where (``file:line``); ``alternatives``: the ways it
    is reached, each taken where its import resolves (see the module's docstring)."""

    alternatives: tuple[Binding, ...]
    where: str
    # An override: our method's signature (vllm_digest's format), checked against the chain's method,
    # and its owner's and its own name ("ShardedStateLoader.save_model").
    override: dict | None = field(default=None, compare=False, hash=False)
    owner: str | None = field(default=None, compare=False, hash=False)

    @property
    def steps(self) -> Chain:
        return self.alternatives[0][1]

    def shown(self) -> str:
        return " or ".join(shown(chain) for _, chain in self.alternatives)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict:
    decorators = decorator_names(node)
    return signature(node, next((k for k in ("staticmethod", "classmethod", "property") if k in decorators), None))


def _call_shape(node: ast.Call) -> Call:
    starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
    positional = sum(1 for a in node.args if not isinstance(a, ast.Starred))
    return Call(positional, tuple(k.arg for k in node.keywords if k.arg is not None), starred)


def _extend(bindings: tuple[Binding, ...], step: Step) -> tuple[Binding, ...]:
    return tuple((guard, (*chain, step)) for guard, chain in bindings)


@dataclass(frozen=True)
class _OwnClass:
    """A class of the package that derives from a vLLM class: the base's chain, and its own names."""

    base: Chain | None
    own: frozenset[str]


Env = dict[str, tuple[Binding, ...]]


class _FileUses:
    """The uses in one file of the package."""

    def __init__(self, text: str, relative: str) -> None:
        self.relative = relative
        self.tree = ast.parse(text)
        self.uses: list[Use] = []
        self.constants = {
            t.id: n.value.value
            for n in self.tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        self.functions = {n.name: n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.module_parameters: dict[str, Env] = {}  # function -> its parameters that receive a vLLM module
        self.returns: dict[str, tuple[Binding, ...]] = {}  # function -> the vLLM chain it returns

    def _where(self, node: ast.AST) -> str:
        return f"{self.relative}:{getattr(node, 'lineno', 0)}"

    def add(self, bindings: tuple[Binding, ...], node: ast.AST, override: dict | None = None, owner: str = "") -> None:
        if bindings and all(chain[0] == "vllm" for _, chain in bindings):
            self.uses.append(Use(bindings, self._where(node), override, owner or None))

    def run(self) -> list[Use]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
                self.add(((None, tuple(node.value.split("."))),), node)
        self._find_module_parameters()
        self._scope(self.tree.body, {}, None)
        return self.uses

    def _find_module_parameters(self) -> None:
        """``after_import("vllm.x", hook)``: ``hook``'s first parameter is that module; and so on through
        the module-level functions of this file that it hands the module to."""
        for node in ast.walk(self.tree):
            if not (
                isinstance(node, ast.Call) and getattr(node.func, "id", None) == "after_import" and len(node.args) == 2
            ):
                continue
            name, hook = node.args
            module = name.value if isinstance(name, ast.Constant) else self.constants.get(getattr(name, "id", ""))
            if isinstance(module, str) and isinstance(hook, ast.Name) and hook.id in self.functions:
                first = self.functions[hook.id].args.args[0].arg
                self.module_parameters.setdefault(hook.id, {})[first] = ((None, tuple(module.split("."))),)
        changed = True
        while changed:
            changed = False
            for caller, bound in list(self.module_parameters.items()):
                for node in ast.walk(self.functions[caller]):
                    callee = self.functions.get(getattr(node.func, "id", "")) if isinstance(node, ast.Call) else None
                    if callee is None:
                        continue
                    for index, arg in enumerate(node.args[: len(callee.args.args)]):
                        parameter = callee.args.args[index].arg
                        known = self.module_parameters.setdefault(callee.name, {})
                        if isinstance(arg, ast.Name) and arg.id in bound and parameter not in known:
                            known[parameter] = bound[arg.id]
                            changed = True

    def _imports(self, body: list[ast.stmt], env: Env) -> None:
        """The names this body's imports bind (not those of nested functions), each import a use; the
        imports of a ``try`` whose handler catches ImportError, with those of that handler, as alternatives."""
        guarded: dict[int, tuple[Chain, ...]] = {}  # an import in a handler -> the imports it stands in for
        for node in _shallow(body):
            if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
                tried = tuple(c for s in node.body for c in _imported(s).values())
                for handler in node.handlers:
                    for stmt in handler.body if _catches_import_error(handler) else []:
                        guarded[id(stmt)] = tried
        first: dict[str, Chain] = {}  # the import a handler's import stands in for, by name
        for node in _shallow(body):
            bound = _imported(node)
            for name, chain in bound.items():
                if id(node) in guarded:
                    previous = first.get(name)
                    env[name] = ((previous, previous), (None, chain)) if previous else ((None, chain),)
                    self.add(env[name], node)
                    continue
                env[name] = ((None, chain),)
                first[name] = chain
                if not any(chain in tried for tried in guarded.values()):
                    self.add(env[name], node)

    def _assignments(self, body: list[ast.stmt], env: Env, cls: _OwnClass | None) -> None:
        """Local names assigned once, from a vLLM chain."""
        counts: dict[str, int] = {}
        values: dict[str, ast.expr] = {}
        for node in _shallow(body):
            targets: list[ast.expr] = node.targets if isinstance(node, ast.Assign) else []
            value = getattr(node, "value", None)
            if isinstance(node, ast.withitem) and node.optional_vars is not None:
                targets, value = [node.optional_vars], node.context_expr
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        counts[name.id] = counts.get(name.id, 0) + 1
                pairs = [(target, value)]
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    pairs = list(zip(target.elts, value.elts, strict=False))  # tp, pp = get_tp_group(), ...
                for one, one_value in pairs:
                    if isinstance(one, ast.Name) and one_value is not None:
                        values[one.id] = one_value
        for name, value in values.items():
            if counts[name] == 1:
                found = self.chains(value, env, cls)
                if found:
                    env[name] = found

    def _scope(self, body: list[ast.stmt], outer: Env, cls: _OwnClass | None, methods: bool = False) -> Env:
        """A function's, a class's or the module's body; ``methods``: a class body, whose functions are
        methods. Returns the body's names."""
        env = dict(outer)
        self._imports(body, env)
        self._assignments(body, env, cls)
        for node in _shallow(body):
            if isinstance(node, ast.ClassDef):
                self._class(node, env)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(node, env, cls, methods)
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                for sub in _walk_expressions(node):
                    if isinstance(sub, (ast.Attribute, ast.Call)):
                        self.add(self.chains(sub, env, cls), sub)
        return env

    def _function(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef, env: Env, cls: _OwnClass | None, method: bool
    ) -> None:
        inner = dict(env)
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        for arg in arguments:
            inner.pop(arg.arg, None)
            if arg.annotation is not None:
                annotated = self.chains(arg.annotation, env, None)
                if annotated:
                    self.add(annotated, arg.annotation)
                    inner[arg.arg] = _extend(annotated, INSTANCE)
        static = "staticmethod" in decorator_names(node)
        if method and cls is not None and cls.base and arguments and not static:
            inner[arguments[0].arg] = SELF
        if not method:
            inner.update(self.module_parameters.get(node.name, {}))
        names = self._scope(node.body, inner, cls)
        if self.functions.get(node.name) is node:
            # A module-level function that returns a vLLM chain (a module it imports and checks, say).
            returned = [r.value for r in _shallow(node.body) if isinstance(r, ast.Return) and r.value is not None]
            if returned and all(isinstance(r, ast.Name) and names.get(r.id) for r in returned):
                ways = {names[r.id] for r in returned}  # type: ignore[union-attr]
                if len(ways) == 1:
                    self.returns[node.name] = ways.pop()

    def _class(self, node: ast.ClassDef, env: Env) -> None:
        base = None
        for b in node.bases:
            found = self.chains(b.value if isinstance(b, ast.Subscript) else b, env, None)
            if found:
                self.add(found, b)
                base = base or found[0][1]
        own = _OwnClass(base, _own_names(node))
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and base is not None:
                private = stmt.name.startswith("_") and not stmt.name.startswith("__")
                if not private and stmt.name not in INHERITED:
                    self.add(((None, (*base, stmt.name)),), stmt, _signature(stmt), f"{node.name}.{stmt.name}")
        self._scope(node.body, env, own, methods=True)

    def chains(self, node: ast.expr, env: Env, cls: _OwnClass | None) -> tuple[Binding, ...]:
        """The ways an expression reaches vLLM: none, one, or one per alternative import."""
        if isinstance(node, ast.Name):
            found = env.get(node.id, ())
            return () if found is SELF else found
        if isinstance(node, ast.Attribute):
            if cls is not None and cls.base is not None:
                if isinstance(node.value, ast.Name) and env.get(node.value.id) is SELF:
                    return () if node.attr in cls.own else ((None, (*cls.base, INSTANCE, node.attr)),)
                if _is_super(node.value):
                    return ((None, (*cls.base, INSTANCE, node.attr)),)
            return _extend(self.chains(node.value, env, cls), node.attr)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in self.returns and node.func.id not in env:
                return self.returns[node.func.id]
            return _extend(self.chains(node.func, env, cls), _call_shape(node))
        return ()


def _imported(node: ast.AST) -> dict[str, Chain]:
    """The vLLM names an import statement binds, and what each is."""
    bound: dict[str, Chain] = {}
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "vllm":
                if alias.asname:
                    bound[alias.asname] = tuple(alias.name.split("."))
                else:
                    bound["vllm"] = ("vllm",)
                    if "." in alias.name:  # import vllm.envs: a use of vllm.envs, bound as vllm
                        bound[f" {alias.name}"] = tuple(alias.name.split("."))
    elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
        for alias in node.names:
            bound[alias.asname or alias.name] = (*node.module.split("."), alias.name)
    return bound


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in IMPORT_ERRORS for t in types)


def _own_names(node: ast.ClassDef) -> frozenset[str]:
    """What a class of the package defines itself: its methods, class attributes and ``self.x`` assignments."""
    names = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                if isinstance(target, ast.Name):
                    names.add(target.id)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and getattr(sub.value, "id", "") == "self":
            names.add(sub.attr)
    return frozenset(names)


def _is_super(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" and not node.args


def _shallow(body: list[ast.stmt]) -> list[ast.AST]:
    """The statements of a body and of its blocks, down to (not into) nested functions and classes,
    with ``except`` handlers and ``with`` items (whose ``as`` names a body may use)."""
    found: list[ast.AST] = []
    queue: list[ast.AST] = list(body)
    while queue:
        node = queue.pop(0)
        found.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, (ast.With, ast.AsyncWith)):
            found.extend(node.items)
        for name in BLOCKS:
            queue.extend(getattr(node, name, []))
    return found


def _walk_expressions(node: ast.AST) -> list[ast.AST]:
    """The expressions of one statement, not those in the bodies of its blocks (statements of their own)."""
    parts: list[ast.AST] = []
    for name, value in ast.iter_fields(node):
        if name in BLOCKS or (name == "items" and isinstance(node, (ast.With, ast.AsyncWith))):
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, ast.AST):
                parts.extend(ast.walk(item))
    return parts


def uses_in(text: str, relative: str = "<source>") -> list[Use]:
    """The vLLM uses of one module's source text (``relative``: its path, as the uses' ``where`` shows it)."""
    return _FileUses(text, relative).run()


@functools.cache
def _package_uses(files: tuple[tuple[str, float], ...]) -> tuple[Use, ...]:
    unique: dict[tuple, Use] = {}
    for name, _ in files:
        path = PACKAGE.parent / name
        for use in uses_in(path.read_text(), name):
            unique.setdefault((use.alternatives, use.override is not None), use)
    return tuple(unique.values())


def uses() -> list[Use]:
    """Every vLLM chain the package uses, once each, with the methods that override vLLM's (``override`` set)."""
    files = sorted(PACKAGE.rglob("*.py"))
    return list(_package_uses(tuple((p.relative_to(PACKAGE.parent).as_posix(), p.stat().st_mtime) for p in files)))
