"""Two nodes against one: a TP=2 load from a bucket, and the bytes each node moves.

One run, on one S3 server (SeaweedFS on loopback) and the same objects: it builds the
Llama-style model of ``load_bench.py`` (``--gb`` GB of bfloat16 weights), saves it sharded
at TP=2 and uploads it, then, for ``--runs`` rounds, alternating the order:

- ``one node``: ``LLM(model="s3://...", load_format="sharded_state", tensor_parallel_size=2)``
  on one node, both workers on it, reading through one counting proxy;
- ``two nodes``: the same engine across two nodes (``tests/support/nodes.py``: each its own mount,
  UTS and network namespace, joined by veth pairs), one worker each, through vLLM's
  multiprocessing executor (``--nnodes 2``; the follower is ``vllm-sharded-serve --headless``),
  each node reading through its own counting proxy.

Reported per setup: the bytes each node read from the bucket (all of its HTTP traffic from
the server: parts, manifest, config and tokenizer, headers), against its ranks' share of the
checkpoint, and the seconds until ``LLM(...)`` returned on the leader (medians). Every engine
must give the same greedy token ids. Needs root (namespaces); without them the two-node rows
share the host's network and disks, and say so.

    python -m benchmarks.nodes_bench --out benchmarks/results       # about 10 minutes here

Writes ``nodes_bench.json`` and ``nodes_bench.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import ROOT, upload

BUCKET = "nodes"
MB = 1e6


def one_node(url: str, proxy, env: dict[str, str], log: Path) -> dict:
    """TP=2 on this machine alone, through ``proxy``."""
    from examples.tiny_models import engine_environment

    spec = {"model": url, "tp": 2, "load_format": "sharded_state"}
    run_env = {**os.environ, **engine_environment(2), **env, "AWS_ENDPOINT_URL": proxy.url}
    run_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "tests.support.engine_runner", json.dumps(spec)],
            cwd=ROOT,
            env=run_env,
            stdout=out,
            stderr=out,
        )
    lines = log.read_text(errors="replace").splitlines()
    result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
    if done.returncode or result is None:
        sys.exit("the one-node engine failed:\n" + "\n".join(lines[-40:]))
    return result


def measure(args: argparse.Namespace) -> dict:
    from examples.s3_server import SeaweedS3
    from tests.support.faultproxy import FaultProxy
    from tests.support.nodes import Nodes, serve_tp2
    from vllm_sharded_loader.checkpoint import read_manifest

    work = args.work or tempfile.mkdtemp(prefix="nodes-bench-")
    hf = harness.build(work, harness.layers_for(args.gb))
    local = os.path.join(work, "sharded-tp2")
    harness.save(hf, local, 2)
    result: dict = {
        "machine": harness.machine(),
        "command": harness.command(),
        "rows": [],
    }
    with (
        SeaweedS3(os.path.join(work, "seaweed")) as server,
        Nodes(Path(tempfile.mkdtemp(prefix="nodes-", dir=work))) as cluster,
        contextlib.ExitStack() as stack,
    ):
        os.environ.update(server.aws_environment())
        server.create_bucket(BUCKET)
        url = f"s3://{BUCKET}/tp2"
        upload(local, url)
        manifest = read_manifest(url)
        assert manifest is not None
        shares = [manifest.rank(r, 0).nbytes for r in range(2)]
        result["checkpoint_bytes"] = sum(shares)
        result["rank_bytes"] = shares
        result["isolated"] = {"network": cluster.isolated_network, "disks": cluster.isolated_disks}
        port = int(server.endpoint.rsplit(":", 1)[1])
        proxies = [stack.enter_context(FaultProxy(port, host=cluster.host_ip)) for _ in range(2)]
        alone = stack.enter_context(FaultProxy(port))
        reference = None
        for run in range(args.runs):
            for setup in ("one node", "two nodes") if run % 2 == 0 else ("two nodes", "one node"):
                for proxy in [*proxies, alone]:
                    proxy.sent = proxy.received = 0
                if setup == "one node":
                    engine = one_node(url, alone, server.aws_environment(), Path(work) / f"one-{run}.log")
                    read = [alone.received]
                else:
                    aws = server.aws_environment()
                    envs = [
                        {**cluster.engine_environment(i), **aws, "AWS_ENDPOINT_URL": proxies[i].url} for i in range(2)
                    ]
                    served = serve_tp2(cluster, url, "sharded_state", f"run-{run}", envs)
                    if not served.follower_ended or served.leftovers:
                        sys.exit(f"the follower did not end by itself: {served.leftovers}")
                    engine = served.result
                    read = [p.received for p in proxies]
                if reference is None:
                    reference = engine["token_ids"]
                elif engine["token_ids"] != reference:
                    sys.exit(f"{setup}, run {run}: other token ids than the first engine")
                row = {
                    "run": run,
                    "setup": setup,
                    "bytes_per_node": read,
                    "llm_seconds": engine["engine_start_seconds"],
                }
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
    return result


def markdown(result: dict) -> str:
    total, shares = result["checkpoint_bytes"], result["rank_bytes"]
    isolated = result["isolated"]
    lines = [
        f"Checkpoint: TP=2, {total / MB:.1f} MB of bfloat16 weights ({', '.join(f'{s / MB:.1f}' for s in shares)} MB "
        "per rank), in SeaweedFS on this machine; medians of "
        f"{len({r['run'] for r in result['rows']})} runs. Nodes in their own network namespaces: "
        f"{'yes' if isolated['network'] else 'no'}; own disks: {'yes' if isolated['disks'] else 'no'}.",
        "",
        "| setup | node | bytes read from the bucket (MB) | of the checkpoint | of its ranks' share | "
        "`LLM(...)` returned after (s) |",
        "|---|---|---|---|---|---|",
    ]
    for setup, ranks in (("one node", [[0, 1]]), ("two nodes", [[0], [1]])):
        rows = [r for r in result["rows"] if r["setup"] == setup]
        seconds = statistics.median(r["llm_seconds"] for r in rows)
        for node, held in enumerate(ranks):
            read = statistics.median(r["bytes_per_node"][node] for r in rows)
            share = sum(shares[r] for r in held)
            lines.append(
                f"| {setup} | {node} (rank{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}) | "
                f"{read / MB:.1f} | {read / total:.0%} | {read / share:.2f}x | {seconds:.1f} |"
            )
    lines += ["", f"Command: `{result['command']}`", f"Machine: {result['machine']}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for nodes_bench.json and nodes_bench.md")
    parser.add_argument("--work", default=None, help="work folder (model, checkpoint, server data)")
    parser.add_argument("--gb", type=float, default=0.5, help="GB of weights of the model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--report", default=None, help="print the table of a saved nodes_bench.json")
    harness.report_or_measure(parser.parse_args(), "nodes_bench", measure, markdown)


if __name__ == "__main__":
    main()
