"""The thin vLLM layer: the only part of the package that imports vLLM.

- :mod:`.plugin`: registration (the loader, the save hook, the post-processing wrapper);
- :mod:`.loader`: the ``sharded_state`` loader class;
- :mod:`.capture`: the loaded state recorded before post-processing, and the save hook;
- :mod:`.layer_geometry`: vLLM's layer classes -> each tensor's geometry;
- :mod:`.identity`: the worker's rank and the served model's identity;
- :mod:`.reload`, :mod:`.layer_steps`, :mod:`.processed`: weight updates in place, one layer at a time;
- :mod:`.save_cli`: the save script's job;
"""
