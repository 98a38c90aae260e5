"""The examples: scripts a user runs (``python examples/demo.py``), and the modules they, the
tests and the benchmarks share (``tiny_models``, ``s3_server``, ``cloud_servers``), imported from the
repository root as ``examples.tiny_models`` and so on. Not part of the installed package."""
