"""The plugin's hooks into vLLM, without starting an engine."""

import pytest
import torch

from vllm_sharded_loader.format.errors import InvalidOption, SaveRefused

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


def test_register_defers_the_hooks_until_vllm_imports_what_they_patch():
    """A process that never loads a model (vLLM's front end, its engine core beside
    separate workers) must not pay for importing vLLM's model loaders (seconds): the hooks
    are applied when vLLM imports those modules, before any of its code can use them."""
    import subprocess
    import sys

    code = """
import sys
from vllm_sharded_loader import register
register()
assert "vllm.model_executor.model_loader" not in sys.modules
assert "vllm_sharded_loader.engine.loader" not in sys.modules
from vllm.config import VllmConfig
assert VllmConfig.try_verify_and_update_config._sharded_state
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import base_loader, get_model_loader
from vllm_sharded_loader.engine.loader import ShardedStateLoader
assert type(get_model_loader(LoadConfig(load_format="sharded_state"))) is ShardedStateLoader
assert base_loader.process_weights_after_loading._records_loaded_state
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
assert "sharded_state" in WeightTransferEngineFactory._registry
assert "vllm_sharded_loader.engine.weight_transfer" not in sys.modules  # imported only when used
from vllm.engine.arg_utils import EngineArgs
assert EngineArgs.create_model_config._sharded_state
assert not any(type(f).__name__ == "_AfterImportFinder" for f in sys.meta_path)
register()
assert not getattr(base_loader.process_weights_after_loading.__wrapped__, "_records_loaded_state", False)
print("hooked")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "hooked" in run.stdout, run.stderr[-3000:]


def test_a_failing_hook_breaks_no_load_format_and_never_hands_sharded_state_to_vllm():
    """A real exception inside the deferred hook, raised during vLLM's own import of its model
    loaders: the import succeeds, every other format loads as without us, the failure is logged,
    and ``sharded_state`` refuses loudly instead of silently becoming vLLM's built-in loader."""
    import subprocess
    import sys

    code = """
import sys
import vllm_sharded_loader.engine.capture as capture
del capture.wrap_process_weights_after_loading  # the hook's own import now fails, for real
from vllm_sharded_loader import register
register()
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import DefaultModelLoader, get_model_loader
from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader as BuiltIn
assert type(get_model_loader(LoadConfig(load_format="auto"))) is DefaultModelLoader
assert type(get_model_loader(LoadConfig(load_format="safetensors"))) is DefaultModelLoader
try:
    loader = get_model_loader(LoadConfig(load_format="sharded_state"))
except RuntimeError as e:
    print("REFUSED", e)
else:
    print("LOADER", type(loader).__module__, isinstance(loader, BuiltIn))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "REFUSED vllm_sharded_loader failed to install its sharded_state loader (ImportError" in run.stdout, (
        run.stdout + run.stderr[-3000:]
    )
    assert "Refusing to fall back to vLLM's built-in loader" in run.stdout
    assert "its hook _install_loader on vllm.model_executor.model_loader failed" in run.stderr


def test_our_loader_keeps_the_public_surface_of_the_class_it_replaces():
    """Code written for vLLM's ShardedStateLoader runs with ours (vLLM's own tests of it among it)."""
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader as BuiltIn

    from vllm_sharded_loader.engine.loader import ShardedStateLoader

    missing = [name for name in vars(BuiltIn) if not name.startswith("__") and not hasattr(ShardedStateLoader, name)]
    assert not missing
    assert ShardedStateLoader.TP_ONLY_PATTERN == "model-rank-{rank}-part-{part}.safetensors"
    assert ShardedStateLoader.PP_AND_TP_PATTERN == "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
    # vLLM's tests/model_executor/model_loader/test_sharded_state_loader.py::test_filter_subtensors (Apache-2.0).
    state_dict = {"a": torch.empty(2), "b": torch.empty((2, 4)), "c": torch.empty((2, 4, 8))}
    state_dict.update({"x": state_dict["b"], "y": state_dict["c"][1, 2, :], "z": state_dict["c"][1, :, 4]})
    filtered = ShardedStateLoader._filter_subtensors(state_dict)
    assert tuple(filtered) == ("a", "b", "c")
    assert all(tensor is state_dict[key] for key, tensor in filtered.items())
    # Instance helpers work on an instance of ours.
    from vllm.config.load import LoadConfig

    loader = ShardedStateLoader(LoadConfig(load_format="sharded_state"))
    assert loader._prepare_weights(".", None) == "."


def test_unknown_extra_config_is_refused():
    from vllm.config.load import LoadConfig

    from vllm_sharded_loader.engine.loader import ShardedStateLoader

    with pytest.raises(InvalidOption, match=r"Unexpected model_loader_extra_config keys \['verfy'\]"):
        ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"verfy": "size"}))
    loader = ShardedStateLoader(
        LoadConfig(load_format="sharded_state", model_loader_extra_config={"pattern": "w-{rank}-{part}.safetensors"})
    )
    assert loader.reader.pattern == "w-{rank}-{part}.safetensors"
    from vllm_sharded_loader.storage.reader import DEFAULT_THREADS

    assert loader.reader.threads == DEFAULT_THREADS
    loader = ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"threads": 2}))
    assert loader.reader.threads == 2
    for bad in (0, "4", True):
        with pytest.raises(InvalidOption, match=r"threads=.* must be a positive integer"):
            ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"threads": bad}))
    assert not loader.reader.huge_pages
    config = {"huge_pages": True}
    pages = ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config=config))
    assert pages.reader.huge_pages
    with pytest.raises(InvalidOption, match=r"huge_pages='yes' .* must be true or false"):
        ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"huge_pages": "yes"}))
    assert loader.reader.mmap
    assert not ShardedStateLoader(
        LoadConfig(load_format="sharded_state", model_loader_extra_config={"mmap": False})
    ).reader.mmap
    config = {"mmap": "auto"}
    auto = ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config=config))
    assert auto.reader.mmap == "auto"
    for bad in (1, "yes"):
        with pytest.raises(InvalidOption, match=r"mmap=.* must be true, false or \"auto\""):
            ShardedStateLoader(LoadConfig(load_format="sharded_state", model_loader_extra_config={"mmap": bad}))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied


def loaded_state(model, quantization=None):
    from vllm_sharded_loader.checkpoint import saveable_state
    from vllm_sharded_loader.checkpoint.loaded_state import LoadedState

    tensors = saveable_state(model.state_dict())
    return LoadedState(
        signature={n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in tensors.items()},
        source=None,
        dtype="float32",
        quantization=quantization,
    )


def test_live_state_is_saved_only_if_provably_the_loaded_one():
    from vllm_sharded_loader.engine.save_hook import _live_state_if_unchanged

    model = Tiny()
    state = loaded_state(model)
    assert set(_live_state_if_unchanged(model, state)) == {"embed.weight", "proj.bias", "proj.weight"}
    # What vLLM's CPU backend does after loading: repack the weight and empty it.
    model.proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(SaveRefused, match=r"proj.weight \(loaded \[4, 4\] float32, now \[0\] float32\)"):
        _live_state_if_unchanged(model, state)
    # Same shape, new memory (an out-of-place transform) is refused too.
    model = Tiny()
    state = loaded_state(model)
    model.proj.weight = torch.nn.Parameter(model.proj.weight.detach().t().contiguous(), requires_grad=False)
    with pytest.raises(SaveRefused, match="SHARDED_STATE_CAPTURE_DIR"):
        _live_state_if_unchanged(model, state)
    with pytest.raises(SaveRefused, match=r"quantized \(fp8\)"):
        _live_state_if_unchanged(Tiny(), loaded_state(Tiny(), quantization="fp8"))


def test_only_parameters_nothing_else_views_are_offered_for_swapping():
    from vllm_sharded_loader.checkpoint.state import adoptable_parameters

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


def test_live_state_with_in_place_post_processing_is_refused():
    from vllm_sharded_loader.engine.save_hook import _live_state_if_unchanged

    class Fp8MoEMethod:  # stands for any method that may rewrite weights at their address
        pass

    model = Tiny()
    state = loaded_state(model)
    model.proj.quant_method = Fp8MoEMethod()
    with pytest.raises(SaveRefused, match=r"Linear \(Fp8MoEMethod\) may rewrite its weights in place"):
        _live_state_if_unchanged(model, state)


def test_weight_updates_through_load_weights_are_counted():

    class Updatable(Tiny):
        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, w in weights:
                params[name].data.copy_(w)
            return {name for name, _ in weights}

    model = Updatable()
    state = loaded_state(model)
    state.count_updates(model)
    state.count_updates(model)  # a second load of the same model: still one count per call
    assert model.load_weights([("proj.bias", torch.ones(4))]) == {"proj.bias"}
    assert state.updates == 1
    assert torch.equal(model.proj.bias, torch.ones(4))
    assert "load_weights" not in dict(model.named_modules()) and "load_weights" not in model.state_dict()


def test_a_failing_record_never_breaks_the_load(caplog):
    from vllm_sharded_loader.engine.capture import (
        LOADED_STATE_ATTRIBUTE,
        RECORD_ERROR_ATTRIBUTE,
        wrap_process_weights_after_loading,
    )

    calls = []

    def original(model, model_config, target_device):
        calls.append(target_device)
        return "processed"

    wrapper = wrap_process_weights_after_loading(original)
    model = Tiny()
    # With a bare model_config the recording fails (outside an engine, on no parallel groups, or,
    # where a convert in this process left its world of one, on the config); the load goes on,
    # and the save hook will have the reason the log gave.
    assert wrapper(model, object(), "cpu") == "processed"
    assert calls == ["cpu"]
    assert LOADED_STATE_ATTRIBUTE not in model.__dict__
    reason = model.__dict__[RECORD_ERROR_ATTRIBUTE]
    assert reason.startswith(("AssertionError: ", "AttributeError: ")) and reason in caplog.text
    assert "recording the loaded state failed" in caplog.text


def test_load_model_leaves_nothing_frozen_even_when_it_fails():
    import gc

    from vllm.config.load import LoadConfig

    from vllm_sharded_loader.engine.loader import ShardedStateLoader

    loader = ShardedStateLoader(LoadConfig(load_format="sharded_state"))
    assert gc.get_freeze_count() == 0
    with pytest.raises(AttributeError):
        loader.load_model(vllm_config=None, model_config=None)  # fails inside vLLM's load_model
    assert gc.get_freeze_count() == 0
    gc.freeze()  # frozen by someone else (vLLM's freeze_gc_heap): left as it is
    try:
        with pytest.raises(AttributeError):
            loader.load_model(vllm_config=None, model_config=None)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
