"""Tools on top of the layers: the ``vllm-sharded`` command (:mod:`.cli`) and the engine-free
checkpoint commands it runs (:mod:`.offline`: inspect, reshard)."""
