"""Times ``load_weights`` of every vLLM model loader, in every process of a benchmark engine.

``benchmarks/load_bench.py`` puts this folder first on ``PYTHONPATH`` of the engines it
starts, so that the front end, the engine core and each tensor-parallel worker (spawned
processes) all import it. When vLLM's ``base_loader`` module is imported, its
``BaseModelLoader.load_model`` is wrapped so that the call to ``self.load_weights`` is
timed the same way for every loader (ours, vLLM's sharded_state, the default safetensors
loader, the Run:ai streamer). One JSON line per load is appended to
``$SHARDED_BENCH_TIMING``. Nothing happens when that variable is unset.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

TARGET = "vllm.model_executor.model_loader.base_loader"


def _patch(module):
    cls = module.BaseModelLoader
    original = cls.load_model

    def load_model(self, *args, **kwargs):
        inner = self.load_weights

        def timed(model, model_config):
            started = time.perf_counter()
            result = inner(model, model_config)
            seconds = time.perf_counter() - started
            try:
                from vllm.distributed import get_tp_group

                rank = get_tp_group().rank_in_group
            except Exception:
                rank = 0
            with open(os.environ["SHARDED_BENCH_TIMING"], "a") as f:
                f.write(json.dumps({"loader": type(self).__name__, "rank": rank, "seconds": seconds}) + "\n")
            return result

        self.load_weights = timed
        try:
            return original(self, *args, **kwargs)
        finally:
            self.__dict__.pop("load_weights", None)

    cls.load_model = load_model


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SHARDED_BENCH_TIMING"):
    sys.meta_path.insert(0, _Finder())
