"""Pure planning: which bytes each rank writes or needs, and where they land.

No I/O, no torch, no vLLM: everything here is tested directly, without files or engines.
"""
