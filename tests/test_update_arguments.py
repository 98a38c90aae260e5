"""Hostile arguments to vLLM's RL weight-update API with the ``sharded_state`` engine, at TP=2.

A bad ``update_info`` (an unknown key, a wrong type, an unknown verify mode) is refused by every
worker alike. vLLM 0.32's multiprocessing executor reads the workers' answers in rank order and
stops at the first failure, so the other workers' answers stayed queued and were taken for the
answers to the next calls: a sound update was then reported refused, and a refused one reported
done. A list of ``update_info`` gives each worker its own: workers told different checkpoints
served a mix of two models without an error, and a list shorter than the workers failed those it
left out inside vLLM, before the plugin ran, while the others waited for them until gloo's
timeout (30 minutes). One server-like engine (A's TP=1 checkpoint,
resharded to TP=2) goes through each request, with each call's error and the greedy tokens after
it; the references are vLLM's default loader's tokens of A and B. Then ``reload_weights`` with a
``weights_path`` that is not a path, which vLLM passes on unchecked.
"""

import json

import pytest

from examples.tiny_models import build_model
from tests.support.engines import run_engine, run_python

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("arguments")
    tokens, saved = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        # float32: greedy tokens agree between TP=1 and TP=2, so a TP=1 reference serves.
        model = build_model(str(root / f"{name}-hf"), "llama", dtype="float32", seed=seed)
        out = saved[name] = str(root / name)
        result = run_engine({"model": model, "capture_dir": out, "save_to": out, "engine": {"dtype": "float32"}}).result
        assert result.get("saved"), result
        tokens[name] = result["token_ids"]
    assert tokens["a"] != tokens["b"]
    a, b = saved["a"], saved["b"]
    requests = [
        {"path": b, "bogus": 1},
        {"path": b},
        {"path": str(root / "never-saved")},
        {"path": a, "verify": "bogus"},
        {"path": 5},
        [{"path": a}, {"path": b}],
        [{"path": a}],
        {"path": a},
        "not a dict",
    ]
    # vLLM's reload_weights passes its weights_path on unchecked.
    steps = [*(["arguments", r] for r in requests), ["reload", 5], ["reload", ""]]
    spec = {"model": a, "tp": 2, "steps": steps, "engine": {"dtype": "float32"}}
    run = run_python(["-m", "tests.support.update_runner", json.dumps(spec)], tp=2)
    assert run.returncode == 0 and run.result is not None, run.tail()
    assert run.result["token_ids"] == tokens["a"]
    return {"steps": run.result["steps"], "tokens": tokens}


# Each request's outcome: what its error says (None: done), and whose tokens are served after it.
EXPECTED = [
    ("unexpected keyword argument 'bogus'", "a"),
    (None, "b"),
    ("no such checkpoint directory", "b"),
    ("is not a verification mode", "b"),
    ("update_info path=5", "b"),
    ("the workers were given different update_info", "b"),
    ("a list of update_info needs an entry for every worker", "b"),
    (None, "a"),
    ("Invalid update_info", "a"),
    ("weights_path=5: expected the folder", "a"),
    ("weights_path='': expected the folder", "a"),
]


@pytest.mark.parametrize("index", range(len(EXPECTED)))
def test_each_request_is_answered_for_itself_and_a_refused_one_changes_nothing(steps, index):
    step = steps["steps"][index]
    message, served = EXPECTED[index]
    if message is None:
        assert step["error"] is None and step.get("finish") is None, step
    else:
        assert step["error"] is not None and message in step["error"], step
        assert "no rank's weights were changed" in step["error"], step
    assert step["token_ids"] == steps["tokens"][served], step["step"]
