"""One rank's load and save, engine-free: the checks, the plan and the I/O, put together.

- :mod:`.load`: :func:`load_rank`, one rank's checked load of a :class:`.request.LoadRequest`
  (same topology, or resharded by :mod:`.reshard`, or a checkpoint of vLLM's own save by :mod:`.legacy`);
- :mod:`.rank_files`: every check of a rank's files against the manifest;
- :mod:`.protocol`: the save protocol, one driver over a store and a group of members; :mod:`.save`: a
  one-process save over it;
- :mod:`.verify`: offline verification of a whole checkpoint;
- :mod:`.state`: which tensors of a model a checkpoint holds.

Needs torch, never vLLM: the engine layer calls in here, and tests do too.
"""

from ..planning.topology import RankInfo
from ..storage.reader import ReadOptions
from .load import load_rank
from .request import LoadRequest, read_manifest
from .state import saveable_state, tensor_specs
from .stats import LoadStats
from .verify import verify_checkpoint

__all__ = [
    "LoadRequest",
    "LoadStats",
    "RankInfo",
    "ReadOptions",
    "load_rank",
    "read_manifest",
    "saveable_state",
    "tensor_specs",
    "verify_checkpoint",
]
