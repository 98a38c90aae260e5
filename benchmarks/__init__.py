"""The benchmarks: one module each, run from the repository root as ``python -m benchmarks.NAME``,
sharing :mod:`benchmarks.harness` (see ``benchmarks/README.md``)."""
