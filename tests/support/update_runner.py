"""Runs one real vLLM engine through a list of weight updates, for tests/test_weight_updates.py.

    python -m tests.support.update_runner '{"model": DIR, "tp": 1, "steps": [["reload", PATH], ["transfer", PATH]]}'

The engine serves ``model`` with ``load_format="sharded_state"`` and the ``sharded_state``
weight-transfer engine. Each step is one update, followed by greedy generation of
``PROMPTS`` of ``examples/tiny_models.py``:

- ``["reload", PATH or null]``: ``collective_rpc("reload_weights", ...)`` (vLLM's in-place reload;
  null: from the checkpoint served);
- ``["transfer", PATH, VERIFY or null]``: vLLM's offline RL API (``start_weight_update``,
  ``update_weights`` with ``{"path": PATH}``, ``finish_weight_update``);
- ``["arguments", UPDATE_INFO]``: the same calls with ``UPDATE_INFO`` as given (any JSON: a
  hostile request), each call's error recorded apart (``error``: start's or update's;
  ``finish``: finish's).

Optional keys: ``extra_config`` (model_loader_extra_config), ``engine`` (extra ``LLM(...)``
arguments). Prints one line ``RESULT {json}``: the token ids at start, then for each step its
token ids, its seconds and its error (if refused).
"""

import contextlib
import json
import sys
import time


def _error_of(call, *args) -> str | None:
    try:
        call(*args)
    except Exception as e:  # reported to the test, which asserts on it
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    from examples.tiny_models import PROMPTS

    tp = spec.get("tp", 1)
    llm = LLM(
        model=spec["model"],
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        load_format="sharded_state",
        model_loader_extra_config=spec.get("extra_config") or {},
        weight_transfer_config={"backend": "sharded_state"},
        max_model_len=512,
        seed=0,
        enforce_eager=True,
        **(spec.get("engine") or {}),
    )
    params = SamplingParams(temperature=0, max_tokens=16)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    llm.init_weight_transfer_engine({"init_info": {}})
    result: dict = {"token_ids": generate(), "steps": []}
    for step in spec["steps"]:
        kind, path, *rest = step
        started = time.perf_counter()
        error = finish = None
        try:
            if kind == "reload":
                llm.collective_rpc("reload_weights", kwargs={} if path is None else {"weights_path": path})
            elif kind == "arguments":
                errors = [_error_of(llm.start_weight_update), _error_of(llm.update_weights, {"update_info": path})]
                error = next((e for e in errors if e is not None), None)
                finish = _error_of(llm.finish_weight_update)
            elif kind == "save":  # vLLM's engine-API save of what is served now
                llm.llm_engine.engine_core.save_sharded_state(path=path)
            else:
                llm.start_weight_update()
                update = {"path": path} | ({"verify": rest[0]} if rest and rest[0] else {})
                try:
                    llm.update_weights({"update_info": update})
                finally:
                    # After a refusal too: at TP>1 only the last worker raised it, the others
                    # still hold the session (see vllm_sharded_loader.engine.reload).
                    with contextlib.suppress(Exception):
                        llm.finish_weight_update()
        except Exception as e:  # reported to the test, which asserts on it
            error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - started
        record = {"step": step, "error": error, "seconds": seconds, "token_ids": generate()}
        result["steps"].append(record | ({"finish": finish} if kind == "arguments" else {}))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
