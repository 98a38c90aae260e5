"""A small model's per-rank state and checkpoints of it, saved and loaded without an engine."""

import torch

from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, ReadOptions, load_rank, read_manifest, saveable_state
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import Manifest, SourceModel, config_sha256, normalize_config
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.progress import ByteProgress

CONFIG = {"hidden_size": 16, "vocab_size": 32, "num_hidden_layers": 2}
SOURCE = SourceModel("TinyForCausalLM", config_sha256(CONFIG), normalize_config(CONFIG))


def rank_state(tp_rank: int, tp_size: int, tied: bool = True) -> dict[str, torch.Tensor]:
    """A rank's slice of a small model, different per rank; lm_head tied to the embedding."""
    g = torch.Generator().manual_seed(100 + tp_rank)
    embed = torch.randn(32 // tp_size, 16, generator=g).to(torch.bfloat16)
    state = {
        "model.embed_tokens.weight": embed,
        "model.layers.0.qkv_proj.weight": torch.randn(48 // tp_size, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.qkv_proj.bias": torch.randn(48 // tp_size, generator=g).to(torch.bfloat16),
        "model.layers.0.o_proj.weight": torch.randn(16, 16 // tp_size, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "model.layers.0.empty": torch.empty(0),  # e.g. a repacked weight: never saved
    }
    state["lm_head.weight"] = embed if tied else embed.clone()
    return state


def save(directory, tp_size=2, max_size=None, pattern=None, tied=True, overwrite=True) -> Manifest:
    ranks = {RankInfo(r, tp_size): saveable_state(rank_state(r, tp_size, tied)) for r in range(tp_size)}
    return save_checkpoint(
        str(directory),
        ranks,
        dtype="bfloat16",
        source=SOURCE,
        options=SaveOptions(pattern=pattern, max_size=max_size, overwrite=overwrite),
    )


class OverwritingProgress(ByteProgress):
    """Verify's progress, whose first call of each pass (once verify has read the manifest, before
    it opens a part) first runs a real save over the checkpoint, as a concurrent reshard with
    ``--overwrite`` publishing at that moment would: a new manifest, the parts of the old removed."""

    def __init__(self, directory, saves: int) -> None:
        super().__init__("Verifying", enabled=False)
        self.directory, self.saves = directory, saves

    def __call__(self, done: int, total: int) -> None:
        if self.total is None and self.saves:
            self.saves -= 1
            save(self.directory)
        super().__call__(done, total)


def fresh_targets(tp_rank, tp_size, tied=True) -> dict[str, torch.Tensor]:
    state = {k: torch.full_like(v, 7) for k, v in rank_state(tp_rank, tp_size, tied).items()}
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return saveable_state(state)


def load(directory, tp_rank=0, tp_size=2, targets=None, experts=None, ep_rank=0, **kw):
    targets = fresh_targets(tp_rank, tp_size) if targets is None else targets
    manifest = read_manifest(str(directory))
    kw.setdefault("serving", SOURCE)
    rank = RankInfo(tp_rank, tp_size, experts=experts, ep_rank=ep_rank)
    options = ReadOptions(**{k: kw.pop(k) for k in list(kw) if k in ReadOptions.__dataclass_fields__})
    adopt = kw.pop("adopt", None)
    return load_rank(LoadRequest(open_store(str(directory)), manifest, **kw), targets, rank, options, adopt), targets


def assert_untouched(targets):
    for name, t in targets.items():
        assert bool((t == 7).all()), f"{name} was written before the load was refused"
