"""The plugin's hooks into vLLM, without starting an engine."""

import pytest
import torch

from vllm_sharded_loader.format import ShardedStateError

vllm = pytest.importorskip("vllm")


def test_plugin_registers_our_loader_once_through_the_entry_point():
    from vllm.config.load import LoadConfig
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader import base_loader, get_model_loader
    from vllm.plugins import load_general_plugins

    from vllm_sharded_loader import register
    from vllm_sharded_loader.engine.loader import ShardedStateLoader

    load_general_plugins()  # what every vLLM process does at start-up
    register()  # and again: must be harmless
    loader = get_model_loader(LoadConfig(load_format="sharded_state"))
    assert type(loader) is ShardedStateLoader
    # The name vLLM's worker save hook resolves at call time.
    assert model_loader.ShardedStateLoader is ShardedStateLoader
    wrapper = base_loader.process_weights_after_loading
    assert wrapper._records_loaded_state
    assert not getattr(wrapper.__wrapped__, "_records_loaded_state", False), "wrapped twice"


def test_unknown_extra_config_is_refused():
    from vllm.config.load import LoadConfig

    from vllm_sharded_loader.engine.loader import ShardedStateLoader

    with pytest.raises(ShardedStateError, match=r"Unexpected model_loader_extra_config keys \['verfy'\]"):
        ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"verfy": "size"}))
    loader = ShardedStateLoader(
        LoadConfig(load_format="sharded_state", model_loader_extra_config={"pattern": "w-{rank}-{part}.safetensors"})
    )
    assert loader.pattern == "w-{rank}-{part}.safetensors"
    from vllm_sharded_loader.storage.reader import DEFAULT_THREADS

    assert loader.threads == DEFAULT_THREADS
    loader = ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"threads": 2}))
    assert loader.threads == 2
    for bad in (0, "4", True):
        with pytest.raises(ShardedStateError, match=r"threads=.* must be a positive integer"):
            ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"threads": bad}))
    assert not loader.huge_pages
    config = {"huge_pages": True}
    assert ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config=config)).huge_pages
    with pytest.raises(ShardedStateError, match=r"huge_pages='yes' .* must be true or false"):
        ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"huge_pages": "yes"}))
    assert loader.mmap
    assert not ShardedStateLoader(
        LoadConfig(load_format="sharded_state", model_loader_extra_config={"mmap": False})
    ).mmap
    with pytest.raises(ShardedStateError, match=r"mmap=1 .* must be true or false"):
        ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"mmap": 1}))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied


def loaded_state(model, quantization=None):
    from vllm_sharded_loader.checkpoint import saveable_state
    from vllm_sharded_loader.engine.capture import LoadedState

    tensors = saveable_state(model.state_dict())
    return LoadedState(
        signature={n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in tensors.items()},
        source=None,
        dtype="float32",
        quantization=quantization,
    )


def test_live_state_is_saved_only_if_provably_the_loaded_one():
    from vllm_sharded_loader.engine.capture import _live_state_if_unchanged

    model = Tiny()
    state = loaded_state(model)
    assert set(_live_state_if_unchanged(model, state)) == {"embed.weight", "proj.bias", "proj.weight"}
    # What vLLM's CPU backend does after loading: repack the weight and empty it.
    model.proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(ShardedStateError, match=r"proj.weight \(loaded \[4, 4\] float32, now \[0\] float32\)"):
        _live_state_if_unchanged(model, state)
    # Same shape, new memory (an out-of-place transform) is refused too.
    model = Tiny()
    state = loaded_state(model)
    model.proj.weight = torch.nn.Parameter(model.proj.weight.detach().t().contiguous(), requires_grad=False)
    with pytest.raises(ShardedStateError, match="SHARDED_STATE_CAPTURE_DIR"):
        _live_state_if_unchanged(model, state)
    with pytest.raises(ShardedStateError, match=r"quantized \(fp8\)"):
        _live_state_if_unchanged(Tiny(), loaded_state(Tiny(), quantization="fp8"))


def test_only_parameters_nothing_else_views_are_offered_for_swapping():
    from vllm_sharded_loader.engine.loader import adoptable_parameters

    model = Tiny()
    model.keeps_a_view = model.proj.weight.data[:2]  # a layer holding on to a parameter's memory
    state = model.state_dict()
    setters = adoptable_parameters(model, state)
    # proj.weight is left out (swapping it would strand the view); the tied pair is one object.
    assert sorted(setters) == ["embed.weight", "head.weight", "proj.bias"]
    mapped = torch.arange(32, dtype=torch.float32).view(8, 4)
    setters["head.weight"](mapped)
    assert model.embed.weight.data_ptr() == model.head.weight.data_ptr() == mapped.data_ptr()
    assert isinstance(model.embed.weight, torch.nn.Parameter)
