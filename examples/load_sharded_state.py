"""Load a sharded checkpoint with ``load_format="sharded_state"`` and generate greedily.

    python examples/load_sharded_state.py --model /path/to/sharded --tensor-parallel-size 2

Prints the time until ``LLM(...)`` returned, and one line of token ids and text per
prompt. Every ``EngineArgs`` flag is accepted; ``--load-format`` defaults to
``sharded_state`` here.
"""

import json
import sys
import time

from tiny_models import PROMPTS
from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_sharded_loader.engine.save_cli import engine_kwargs


def main() -> int:
    parser = FlexibleArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(load_format="sharded_state")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args()
    engine_args = EngineArgs.from_cli_args(args)
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(engine_args))
    start_seconds = time.perf_counter() - started
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    if args.json:
        print(json.dumps({"engine_start_seconds": start_seconds, "token_ids": tokens}))
    else:
        print(f"LLM(...) with load_format={engine_args.load_format!r} returned in {start_seconds:.1f} s")
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            print(f"{prompt!r} -> {output.outputs[0].text!r} {list(output.outputs[0].token_ids)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
