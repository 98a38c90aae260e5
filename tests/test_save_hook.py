"""vLLM's save hook (``engine/save_hook.py``) on one worker, without an engine.

A child process sets up vLLM's parallel groups for one process (gloo), as a worker has them,
and calls the hook on a small model with a recorded loaded state: it saves through the one save
driver, refuses an existing checkpoint with an agreed :class:`SaveRefused` that names the
abandon, overwrites from its published capture once that capture's content is proven, and
publishes a start-up capture in place.
"""

from __future__ import annotations

import os
import textwrap

from examples.tiny_models import engine_environment
from tests.support.engines import python_process

CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{sys.argv[2]}", 0, "gloo")
        initialize_model_parallel(1, 1)
    from vllm_sharded_loader.checkpoint import read_manifest
    from vllm_sharded_loader.storage.staged import new_token, stage_rank
    from vllm_sharded_loader.checkpoint.loaded_state import OVERWRITE_ENV, LoadedState
    from vllm_sharded_loader.engine import capture, save_hook
    from vllm_sharded_loader.format import SaveRefused, SourceModel, config_sha256, normalize_config
    from vllm_sharded_loader.planning.topology import RankInfo

    source = SourceModel("TinyForCausalLM", config_sha256({}), normalize_config({}))

    def model_with_state(capture_dir=None):
        model = torch.nn.Linear(4, 4)
        tensors = dict(model.state_dict())
        state = LoadedState(
            signature={n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in tensors.items()},
            source=source, dtype="float32", quantization=None, rank=RankInfo(0, 1),
        )
        if capture_dir:
            os.makedirs(capture_dir)
            state.capture = stage_rank(capture_dir, tensors, RankInfo(0, 1), None, None, new_token())
        model.__dict__[capture.LOADED_STATE_ATTRIBUTE] = state
        return model, state

    out = os.path.join(sys.argv[1], "ckpt")
    model, state = model_with_state()
    save_hook.save_rank_from_hook(model, out, None, None)  # the live state, provably the loaded one
    assert sorted(os.listdir(out)) == ["model-rank-0-part-0.safetensors", "sharded_state.json"], os.listdir(out)
    try:
        save_hook.save_rank_from_hook(model, out, None, None)
        raise SystemExit("an existing checkpoint was not refused")
    except SaveRefused as e:
        assert e.agreed and "already holds a checkpoint" in str(e) and "previous checkpoint there is intact" in str(e)
    os.environ[OVERWRITE_ENV] = "1"
    save_hook.save_rank_from_hook(model, out, None, None)  # from the published capture, content checked
    assert sorted(os.listdir(out)) == ["model-rank-0-part-1.safetensors", "sharded_state.json"], os.listdir(out)
    assert state.capture is not None and not state.capture.temporary and state.updates == 0

    inside = os.path.join(sys.argv[1], "captured")
    model, state = model_with_state(inside)
    staged_name = state.capture.entry.files[0].name
    save_hook.save_rank_from_hook(model, inside, None, None)  # the capture is published in place
    assert read_manifest(inside).ranks[0].files[0].name == staged_name
    assert not state.capture.temporary
    print("hook ok")
    """
)


def test_the_save_hook_runs_the_one_driver_on_a_worker(tmp_path):
    port = 20000 + (tmp_path.stat().st_ino % 20000)
    run = python_process(["-c", CHILD, str(tmp_path), str(port)], {**os.environ, **engine_environment()}, timeout=300)
    assert run.returncode == 0 and "hook ok" in run.stdout, run.stderr[-3000:]
