"""Convert several model families, each at TP=1 and at larger TP x PP sizes, in one process, and check
every larger checkpoint against the TP=1 one: resharded back to TP=1 offline, every tensor equal byte
for byte, and ``verify``'s checksums passed.

    python -m tests.support.convert_sizes_runner SPEC_JSON

SPEC: ``{"root": DIR, "models": {NAME: [FAMILY_OR_KIND, {config fields}]}, "sizes": [[TP, PP], ...]}``;
a family of ``examples.tiny_models.FAMILIES`` or a kind of its ``MODEL_KINDS``; optionally
``"min_stacked_bytes"``, for :data:`..checkpoint.rank_cut.MIN_STACKED_BYTES` at the larger sizes
(0: a tiny MoE's stacked experts are cut into views, as a real model's are), the TP=1 reference
then made with every stacked cut joined (a copy, independent of how views are ordered). Prints one ``RESULT``
line: for each model, for each size ``"TPxPP"``, ``"equal"`` or what failed.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from examples.tiny_models import FAMILIES, build_family, build_model, family_engine_args
from tests.support.derived import tensors_of
from vllm_sharded_loader.checkpoint import rank_cut
from vllm_sharded_loader.checkpoint.meta_model import ModelOptions
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.tools.convert import ConvertOptions, convert_checkpoint
from vllm_sharded_loader.tools.offline import reshard_checkpoint


def tensors(directory: str) -> dict[str, torch.Tensor]:
    """A TP=1, PP=1 checkpoint's tensors, by name (the files its manifest lists)."""
    return {name: t for (_, _, name), t in tensors_of(directory).items()}


def check(model: str, out: str, tp: int, pp: int, base: dict[str, torch.Tensor], options: dict) -> str:
    try:
        convert_checkpoint(model, out, tp, pp, ConvertOptions(ModelOptions(**options)))
        problems = verify_checkpoint(open_store(out))
        if problems:
            return f"verify: {problems[:3]}"
        back = f"{out}-back"
        reshard_checkpoint(open_store(out), back, 1, 1)
    except Exception as e:  # reported by the test, with the size it failed at
        return f"{type(e).__name__}: {e}"
    got = tensors(back)
    names = base.keys() | got.keys()
    differ = sorted(n for n in names if n not in base or n not in got or not torch.equal(base[n], got[n]))
    return "equal" if not differ else f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def main() -> None:
    spec = json.loads(sys.argv[1])
    views = spec.get("min_stacked_bytes", rank_cut.MIN_STACKED_BYTES)
    joined = rank_cut.MIN_STACKED_BYTES if "min_stacked_bytes" not in spec else 1 << 62
    results: dict[str, dict[str, str]] = {}
    for name, (what, fields) in spec["models"].items():
        root = os.path.join(spec["root"], name)
        if what in FAMILIES:
            model = build_family(os.path.join(root, "hf"), what, fields=fields)
            engine = family_engine_args(model, what)
        else:
            model = build_model(os.path.join(root, "hf"), what, **fields)
            engine = {}
        options = {k: engine[k] for k in ("runner", "convert") if k in engine}
        rank_cut.MIN_STACKED_BYTES = joined
        convert_checkpoint(model, os.path.join(root, "1x1"), 1, 1, ConvertOptions(ModelOptions(**options)))
        rank_cut.MIN_STACKED_BYTES = views
        base = tensors(os.path.join(root, "1x1"))
        results[name] = {
            f"{tp}x{pp}": check(model, os.path.join(root, f"{tp}x{pp}"), tp, pp, base, options)
            for tp, pp in spec["sizes"]
        }
        print(name, results[name], flush=True)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
