"""One rank's load and save, engine-free: the checks, the plan and the I/O, put together
(:func:`load_rank`, the save protocol in :mod:`.protocol`, :func:`verify_checkpoint`).

Needs torch, never vLLM: the engine layer calls in here, and tests do too.
"""

from ..planning.topology import RankInfo
from ..storage.location import read_manifest
from ..storage.reader import ReadOptions
from .load import load_rank
from .request import LoadRequest
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
