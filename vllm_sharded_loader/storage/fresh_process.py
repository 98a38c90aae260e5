"""Object-storage calls in a fresh process, for a process that forks afterwards: obstore's runtime
does not survive ``fork()`` (a child hangs on its first request), and vLLM forks its engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ..format import errors
from ..format.errors import ShardedStateError, StorageError
from ..format.names import check_carried_name

_CALL = """
import importlib, json, sys
from vllm_sharded_loader.format.errors import ShardedStateError
function = importlib.import_module(sys.argv[1])
for part in sys.argv[2].split("."):
    function = getattr(function, part)
try:
    answer = {"result": function(*json.loads(sys.argv[3]))}
except ShardedStateError as e:
    answer = {"error": type(e).__name__, "message": str(e)}
print("\\n" + json.dumps(answer), flush=True)
"""


def in_fresh_process(function: Callable[..., Any], *args: Any, timeout: float = 600.0) -> Any:
    """``function(*args)`` (a module-level function of this package, JSON in and out) run in a fresh
    Python process, killed past ``timeout``: its value, or its :class:`ShardedStateError` raised here."""
    call = [function.__module__, function.__qualname__, json.dumps(list(args))]
    try:
        done = subprocess.run([sys.executable, "-c", _CALL, *call], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise StorageError(f"{function.__qualname__}{tuple(args)} took longer than {timeout:.0f} s.") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        said = done.stderr.strip().splitlines()
        raise ShardedStateError(
            f"{function.__qualname__}{tuple(args)} failed in its process (exit code {done.returncode}): "
            f"{said[-1] if said else 'no message'}"
        )
    answer = json.loads(lines[-1])
    if "error" not in answer:
        return answer["result"]
    error = getattr(errors, answer["error"], None)
    if not (isinstance(error, type) and issubclass(error, ShardedStateError)):
        error = ShardedStateError  # a subclass defined elsewhere: the base type, the same message
    raise error(answer["message"])


def _copy_objects(url: str, names: list[str], folder: str) -> None:
    from .objects import ObjectPrefix, read_object

    where = ObjectPrefix.parse(url)
    for name in names:
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "xb") as f:
            f.write(read_object(where, name))


def copy_objects(url: str, names: list[str], folder: str) -> None:
    """Copy the objects ``names`` of the prefix ``url`` into the existing local ``folder``, from a fresh
    process; raises :class:`ShardedStateError` naming an object that cannot be read."""
    for name in names:
        check_carried_name(name, url)
    in_fresh_process(_copy_objects, url, names, folder)
