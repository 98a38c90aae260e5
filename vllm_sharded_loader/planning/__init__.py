"""Pure planning: which bytes each rank writes or needs, and where they land.

- :mod:`.parts`: which tensors a rank saves (shared memory once) and in which parts;
- :mod:`.tensors`: whether a saved rank holds exactly the tensors a model expects;
- :mod:`.topology`: the worker's place in the TP/PP grid, and topology and source checks;
- :mod:`.spans`: planned byte ranges cut into the reader's spans;
- :mod:`.layout`: vLLM's sharding rule for a tensor geometry at one TP size;
- :mod:`.reads`: resharding reads (saved ranks -> one serving rank);
- :mod:`.runs`: the strided byte and element runs a read plan is made of;
- :mod:`.manifest_plans`: those reads over a manifest, and the checks around them;
- :mod:`.pipeline`: vLLM's pipeline split of decoder layers.

No I/O, no torch, no vLLM: everything here is tested directly, without files or engines.
"""
