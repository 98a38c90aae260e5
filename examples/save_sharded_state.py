"""Save a model as a per-rank sharded checkpoint that reloads with ``--load-format sharded_state``.

Same command line as vLLM's example of the same name: every engine flag, plus
``--output/-o``, ``--file-pattern`` and ``--max-file-size`` (default 5 GiB)::

    python examples/save_sharded_state.py --model /path/to/hf-model \\
        --tensor-parallel-size 2 --output /path/to/sharded

Then serve it::

    python -m vllm.entrypoints.openai.api_server --model /path/to/sharded \\
        --load-format sharded_state --tensor-parallel-size 2
"""

import sys

from vllm_sharded_loader.engine.save_cli import main

if __name__ == "__main__":
    sys.exit(main())
