"""Pure planning: which bytes each rank writes or needs, and where they land. No I/O, torch or vLLM."""
