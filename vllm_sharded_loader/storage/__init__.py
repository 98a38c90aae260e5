"""Storage I/O: moving bytes between files and tensors, and the places files live.

- :mod:`.location`: :func:`~.location.open_store`, a checkpoint's location resolved once into a
  store (:mod:`.folder`: a local folder; :mod:`.object_store`: an object prefix; :mod:`.in_memory`:
  this process's memory), which reads it, locks it and runs a save's steps there;
- :mod:`.staged`: one rank's parts written under temporary names (a save's stage step);
- :mod:`.reader`: the parallel reader (planned spans of files into tensors), with
  :mod:`.memory` (targets, private file mappings) and :mod:`.staging` (per-thread buffers);
- :mod:`.writer`: safetensors files written straight from tensor memory;
- :mod:`.integrity`: block checksums, computed and verified as bytes stream;
- :mod:`.local`: a checkpoint directory (manifest, part paths, headers);
- :mod:`.lock`: the save lock;
- :mod:`.hub`: per-rank fetches from the Hugging Face Hub;
- :mod:`.tensors`, :mod:`.oscalls`: dtypes and byte views; the Linux calls ``os`` lacks.

Needs torch, never vLLM.
"""
