"""Storage I/O: moving bytes between files and tensors, and the places files live (a store per
location, :func:`~.location.open_store`). Needs torch, never vLLM."""
