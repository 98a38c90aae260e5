"""The `vllm-sharded` command on real checkpoints written by the save path."""

import contextlib
import json
import math
import re
import subprocess
import sys

import pytest
import torch

from tests.support.checkpoints import moe_weights, save_model, save_replicas, stage_state
from tests.support.engines import package_process
from tests.support.manifests import edit_manifest
from tests.support.reference import llama_like
from tests.support.states import OverwritingProgress, save
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.format import LOCK_NAME, MANIFEST_NAME
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.tools.cli import main as cli


@pytest.fixture
def checkpoint(tmp_path):
    model = llama_like(tied=True, num_layers=4)
    save_model(tmp_path / "tp2", model, 2, 1)
    return model, tmp_path / "tp2"


def test_help_reads_well():
    out = subprocess.run(
        [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    for command in ("save", "inspect", "verify", "reshard"):
        assert command in out.stdout


def test_the_command_exits_with_its_code_and_all_its_output_through_a_pipe(checkpoint, tmp_path):
    """``vllm-sharded`` ends without Python's module teardown (``run``): what it printed still
    arrives whole, buffered and through a pipe, and its exit code is the command's."""
    _, directory = checkpoint
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli"]
    out = subprocess.run([*command, "inspect", "--json", str(directory)], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["tp_size"] == 2
    out = subprocess.run([*command, "verify", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and f"BAD: {tmp_path} has 1 problem(s)" in out.stdout
    out = subprocess.run([*command, "inspect", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and f"{tmp_path} has no {MANIFEST_NAME}" in out.stderr


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--json"], ["verify"]], ids=" ".join)
def test_a_reader_that_goes_away_ends_the_command_by_sigpipe_not_an_error_line(checkpoint, args):
    """``vllm-sharded inspect DIR | head``: once the reader is gone, the command said
    ``vllm-sharded: error: [Errno 32] Broken pipe`` and exited 2, as if it had failed. It now ends
    as any command whose reader went away, by SIGPIPE, and says nothing."""
    import signal

    _, directory = checkpoint
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", *args, str(directory)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # (before it prints: it is still starting)
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == -signal.SIGPIPE and stderr == "", stderr


def test_inspect(checkpoint, capsys):
    _, directory = checkpoint
    assert cli(["inspect", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "TP=2 PP=1" in text and "resharding    possible" in text and "checksums: yes" in text
    assert cli(["inspect", "--json", str(directory)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["tp_size"], info["pp_size"], info["dtype"]) == (2, 1, "int32")
    assert (
        info["geometry"]["reshardable"] and info["geometry"]["kinds"]["qkv_parallel"] == 8
    )  # weight and bias, 4 layers
    assert len(info["ranks"]) == 2 and all(f["checksum"] for r in info["ranks"] for f in r["files"])


def test_inspect_prints_a_name_with_control_characters_as_one_line_of_what_it_is(checkpoint, capsys):
    """A manifest's strings are a hostile file's words: an architecture with a line break and terminal
    escapes (a forged "LOCKED" line, a cleared line, reversed text) prints escaped, on its own line."""
    _, directory = checkpoint
    forged = "LlamaForCausalLM\n  LOCKED        no\x1b[2K\u202e"

    def rename(manifest):
        manifest["source"]["architecture"] = forged

    edit_manifest(directory, rename)
    assert cli(["inspect", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\u202e" not in text
    assert [line for line in text.splitlines() if "LOCKED" in line] == [
        "  source model  LlamaForCausalLM\\n  LOCKED        no\\x1b[2K\\u202e (config sha256 "
        + read_manifest(str(directory)).source.config_sha256[:16]
        + ")"
    ]


def test_inspect_and_verify_show_experts_saved_per_replica(tmp_path, capsys):
    save_replicas(tmp_path, moe_weights(), 1, 2, "linear")
    assert cli(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "TP=1 PP=1 DP=2" in text and "EP=2 linear" in text and "written by each of 2 replicas" in text
    assert "pp 0 dp 1 tp 0  model-dp-1-rank-0-part-0.safetensors" in text
    assert cli(["verify", str(tmp_path)]) == 0


def test_verify_good_and_bad(checkpoint, capsys):
    _, directory = checkpoint
    assert cli(["verify", str(directory)]) == 0
    part = directory / "model-rank-1-part-0.safetensors"
    part.write_bytes(part.read_bytes()[:-1])
    assert cli(["verify", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "model-rank-1-part-0.safetensors" in out and "truncated" in out


def test_verify_of_a_checkpoint_that_a_save_replaces_meanwhile_verifies_the_new_one(tmp_path, capsys):
    """Verify read the manifest, then a save published another and removed the old one's parts: the
    checkpoint is sound, not "incomplete" with every part "missing". Verify checks the one that
    replaced it, from the start, and says so; replaced again during that, it says to run it again."""
    directory = tmp_path / "ckpt"
    save(directory)
    first = read_manifest(str(directory))
    notes: list[str] = []
    progress = OverwritingProgress(directory, saves=1)
    assert verify_checkpoint(open_store(str(directory)), notes=notes, progress=progress) == []
    assert read_manifest(str(directory)) != first
    assert notes == [
        f"{directory / MANIFEST_NAME}: a save replaced the checkpoint while it was being verified (it published "
        "this manifest and removed the parts of the one read first); the checkpoint verified here is the one "
        "that replaced it."
    ]
    assert progress.nbytes == progress.total  # (counted from nothing for the second pass)

    # Bounded: a second save during the second pass ends the verify with that, not a third pass.
    progress = OverwritingProgress(directory, saves=3)
    assert verify_checkpoint(open_store(str(directory)), progress=progress) == [
        f"{directory / MANIFEST_NAME}: a save replaced the checkpoint while it was being verified, and another "
        "replaced that one while it was verified again; run verify again once no save writes into it."
    ]
    assert progress.saves == 1


def on_a_terminal(args: list[str]) -> tuple[int, list[str]]:
    """Run ``vllm-sharded ARGS`` with standard error on a real pseudo-terminal, 120 columns wide (a
    fresh one has 0, where tqdm draws nothing); its exit code and the lines drawn there."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=follower) as proc:
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command closed its side
                break
            if not chunk:
                break
            shown += chunk
        code = proc.wait(timeout=120)
    os.close(leader)
    lines = shown.decode(errors="replace").replace("\r", "\n").strip().splitlines()
    return code, lines


def test_reshard_and_verify_show_progress_on_a_terminal_and_nothing_through_a_pipe(checkpoint, tmp_path):
    """Long offline work shows progress where someone watches: on a terminal, one bar, complete at
    the end, of the bytes every output rank writes (reshard) or of every part's bytes read for its
    checksums (verify); through a pipe (a log), only the closing lines."""
    from tqdm import tqdm

    _, directory = checkpoint
    code, shown = on_a_terminal(["reshard", str(directory), "-tp", "4", "-o", str(tmp_path / "tty")])
    assert code == 0
    final = shown[-1]
    manifest = read_manifest(str(tmp_path / "tty"))
    itemsize = {"I32": 4}  # the tiny Llama of tests/support/reference.py is int32
    # Every rank's tensor bytes (the files' headers aside), as tqdm writes a size.
    size = tqdm.format_sizeof(
        sum(math.prod(t.shape) * itemsize[t.dtype] for r in manifest.ranks for t in r.tensors.values()), divisor=1000
    )
    assert final.startswith("Resharding: 100%") and f" {size}/{size} " in final, (size, final)
    code, shown = on_a_terminal(["verify", str(tmp_path / "tty")])
    final = shown[-1]
    size = tqdm.format_sizeof(sum(f.size for r in manifest.ranks for f in r.files), divisor=1000)
    assert code == 0 and final.startswith("Verifying: 100%") and f" {size}/{size} " in final, (size, final)
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli"]
    piped = subprocess.run(
        [*command, "reshard", str(directory), "-tp", "4", "-o", str(tmp_path / "pipe")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0 and "Resharded" in piped.stdout
    assert "Resharding" not in piped.stderr, piped.stderr
    piped = subprocess.run([*command, "verify", str(tmp_path / "pipe")], capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and "OK:" in piped.stdout and "Verifying" not in piped.stderr, piped.stderr
    # Refused (the output is a checkpoint, and no --overwrite): the error alone, no bar drawn first.
    code, shown = on_a_terminal(["reshard", str(directory), "-tp", "4", "-o", str(tmp_path / "tty")])
    assert code != 0 and shown and not any("Resharding" in line for line in shown), shown
    assert "already" in shown[-1].lower() or "overwrite" in shown[-1].lower(), shown


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (4, 1), (1, 2), (2, 4)])
def test_reshard_offline_then_load_without_resharding(checkpoint, tmp_path, tp, pp, capsys):
    model, directory = checkpoint
    (directory / "config.json").write_text("{}")  # a non-weight file to carry along
    out = tmp_path / "out"
    args = ["reshard", str(directory), "--tensor-parallel-size", str(tp), "--output", str(out)]
    assert cli([*args, "--pipeline-parallel-size", str(pp), "--max-file-size", "2048"]) == 0
    assert "Resharded" in capsys.readouterr().out
    manifest = read_manifest(str(out))
    assert (manifest.tp_size, manifest.pp_size) == (tp, pp)
    assert (out / "config.json").exists()
    assert cli(["verify", str(out)]) == 0
    for p in range(pp):
        for t in range(tp):
            expected = stage_state(model, tp, pp, t, p)
            targets = {n: torch.zeros_like(x) for n, x in expected.items()}
            stats = load_rank(LoadRequest(open_store(str(out)), manifest), targets, RankInfo(t, tp, p, pp))
            assert stats.resharded_from is None  # written for this topology: a plain load
            for name, x in expected.items():
                assert torch.equal(targets[name], x), name


def test_reshard_refused_clearly(checkpoint, tmp_path, capsys):
    _, directory = checkpoint
    # 2 KV heads cannot be split over 3 ranks: one clear line, non-zero exit, no output left.
    out = tmp_path / "out"
    assert cli(["reshard", str(directory), "-tp", "3", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-sharded: error: ") and "Traceback" not in err
    assert not out.exists()
    # A checkpoint without geometry cannot be resharded either.
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    del manifest["geometry"]
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert cli(["reshard", str(directory), "-tp", "1", "-o", str(out)]) == 2
    assert "cannot be resharded from TP=2 to TP=1" in capsys.readouterr().err  # names the tensor and why


def test_reshard_to_another_pp_size_refuses_saved_layers_its_config_does_not_count(tmp_path, capsys):
    """Saved tensors of decoder layers beyond the layer count of the manifest's config are in no
    stage's range: a reshard to another PP size wrote them into no stage and published an output
    without them (12 tensors of layer 2 here), which verify called sound."""
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.format import SourceModel, config_sha256, normalize_config

    model = llama_like(num_layers=3, vocab=128, kv_heads=2)
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}  # three were saved
    source = SourceModel("LlamaForCausalLM", config_sha256(config), normalize_config(config))
    directory, out = tmp_path / "ckpt", tmp_path / "out"
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    ranks = {RankInfo(0, 1): stage_state(model, 1, 1, 0, 0)}
    save_checkpoint(str(directory), ranks, dtype="int32", source=source, options=SaveOptions(geometry=geometry))
    assert cli(["reshard", str(directory), "-tp", "1", "-pp", "2", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{directory / MANIFEST_NAME}: 12 saved tensors belong to decoder layers beyond the 2 layers" in err
    assert "'model.layers.2." in err and "Keep the saved pipeline parallel size (PP=1)" in err
    assert not out.exists()


def test_reshard_to_another_pp_size_names_a_layer_index_of_thousands_of_digits(checkpoint, tmp_path, capsys):
    """A manifest's tensor names are unbounded: one of a layer whose index has 5000 digits made the
    pipeline split raise Python's bare ValueError (int() takes at most 4300 digits), and the command
    printed a traceback instead of naming the tensor; a resharding load under PP did the same."""
    _, directory = checkpoint
    old, new = "model.layers.1.input_layernorm.weight", "model.layers." + "9" * 5000 + ".input_layernorm.weight"

    def rename(data: dict) -> None:
        for rank in data["ranks"]:
            rank["tensors"][new] = rank["tensors"].pop(old)
        data["geometry"][new] = data["geometry"].pop(old)

    edit_manifest(directory, rename)
    out = tmp_path / "out"
    assert cli(["reshard", str(directory), "-tp", "1", "-pp", "2", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Tensor 'model.layers.999" in err and "names a decoder layer index of 5000 digits" in err, err[-300:]
    assert not out.exists()


def test_reshard_refuses_a_carried_file_that_is_not_what_its_save_recorded(checkpoint, tmp_path, capsys):
    """A tokenizer changed since the save: reshard carried it and recorded it anew, so that its output
    verified (it certified the damage); refused by name, before anything is written."""
    _, directory = checkpoint
    (directory / "tokenizer.json").write_text('{"a": 1}')
    first, out = tmp_path / "first", tmp_path / "out"
    assert cli(["reshard", str(directory), "-tp", "1", "-o", str(first)]) == 0
    assert read_manifest(str(first)).carried_files["tokenizer.json"].size == 8
    (first / "tokenizer.json").write_text('{"a": 2}')
    capsys.readouterr()
    assert cli(["reshard", str(first), "-tp", "2", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"vllm-sharded: error: Not resharding {first}: files it carries are not what its save recorded (1: named "
        "below), and the output would carry them and record them as sound; nothing was written. Put them right and "
        f"reshard again. {first / 'tokenizer.json'}: SHA-256 "
    ), err
    assert not out.exists()


def test_reshard_refuses_an_unrecorded_file_that_links_out_of_the_source_and_copies_nothing(checkpoint, tmp_path):
    """A checkpoint whose manifest records no carried files (an earlier version's save, the save
    hook's into the model's folder) has the files beside its parts copied as they are: a
    ``tokenizer.json`` that links out of it (to a key, a secret) was read through the link and
    copied into the output as a regular file, recorded as sound (and uploaded, into a bucket).
    No load or verify reads through such a link; the reshard now refuses it, naming it, and writes
    nothing. A link that stays inside the checkpoint is copied as before."""
    import os

    _, directory = checkpoint
    assert read_manifest(str(directory)).carried_files == {}
    (tmp_path / "secret.txt").write_text("the user's secret")
    (directory / "tokenizer.json").symlink_to(tmp_path / "secret.txt")
    output = tmp_path / "out"
    command = ["reshard", str(directory), "-tp", "1", "-o", str(output)]
    assert cli(command) == 2
    assert not output.exists()
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.json").write_text("the checkpoint's own")
    (directory / "tokenizer.json").symlink_to("vocab.json")
    assert cli(command) == 0
    assert (output / "tokenizer.json").read_text() == "the checkpoint's own"
    assert not any("secret" in p.read_text(errors="replace") for p in output.iterdir() if p.is_file())
    assert os.path.islink(directory / "tokenizer.json")


def test_reshard_into_the_source_through_a_link_is_refused_and_changes_nothing(checkpoint, tmp_path, capsys):
    """An output that is the source under another name (a symbolic link to it) was written into,
    and with --overwrite the source's own parts were removed as the old checkpoint's."""
    _, directory = checkpoint
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    link = tmp_path / "link"
    link.symlink_to(directory)
    for extra in ([], ["--overwrite"]):
        assert cli(["reshard", str(directory), "-tp", "1", "-o", str(link), *extra]) == 2
        err = capsys.readouterr().err
        assert err == "vllm-sharded: error: --output must be another directory than the source checkpoint.\n"
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def test_reshard_into_a_folder_inside_the_source_is_refused_and_changes_nothing(checkpoint, tmp_path, capsys):
    """An output inside the source (its tokenizer folder, say) was written among the source's files;
    that folder, now holding a checkpoint, was no longer carried: the output and every later copy of
    the source lacked it, and all of them verified."""
    _, directory = checkpoint
    (directory / "tokenizer").mkdir()
    before = sorted(p for p in directory.rglob("*"))
    link = tmp_path / "link"
    link.symlink_to(directory)
    for output in (directory / "tokenizer", directory / "new", link / "new"):
        assert cli(["reshard", str(directory), "-tp", "1", "-o", str(output), "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"vllm-sharded: error: --output {output} lies inside the source checkpoint {directory}; nothing was "
            "written. Choose a folder outside the source.\n"
        )
        assert sorted(p for p in directory.rglob("*")) == before


def test_verify_of_a_file_claims_no_save_lock(tmp_path, capsys):
    """A path that is a file has no lock under it; verify said a save held it or was interrupted."""
    path = tmp_path / "notes.txt"
    path.write_text("not a checkpoint")
    assert cli(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert out == (
        f"BAD: {path} has 1 problem(s):\n  - {path} is a file, where a checkpoint folder (the one that holds "
        f"{MANIFEST_NAME}) was expected; check the path. Nothing to verify.\n"
    )
    assert path.read_text() == "not a checkpoint"


@pytest.mark.parametrize(
    "holds, said",
    [
        (
            "safetensors",
            "holds a Hugging Face model (model.safetensors), not a sharded checkpoint (no "
            f"{MANIFEST_NAME}): convert it with `vllm-sharded convert",
        ),
        (
            "bin",
            "holds a Hugging Face model (pytorch_model.bin), not a sharded checkpoint (no "
            f"{MANIFEST_NAME}): save it with `vllm-sharded save` (convert reads safetensors only)",
        ),
        (
            "vllm parts",
            f"has no {MANIFEST_NAME}, only parts named as vLLM's own save names them "
            "(model-rank-0-part-0.safetensors, model-rank-0-part-1.safetensors, ... (42 in all)): a checkpoint of "
            "vLLM's save_sharded_state",
        ),
    ],
    ids=["safetensors", "bin", "vllm parts"],
)
def test_a_folder_without_manifest_is_said_to_hold_what_it_holds(checkpoint, tmp_path, capsys, holds, said):
    """A Hugging Face model folder given to verify, inspect or reshard (an easy slip: convert takes one)
    was said to be "incomplete or written by vLLM's own save"; it is named, with the command it needs."""
    import shutil

    from safetensors.torch import save_file

    _, directory = checkpoint
    folder = tmp_path / "given"
    if holds == "vllm parts":
        shutil.copytree(directory, folder)
        (folder / MANIFEST_NAME).unlink()
    else:
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "llama"}')
        if holds == "bin":
            (folder / "pytorch_model.bin").write_bytes(b"pickled")
        else:
            save_file({"w": torch.ones(2)}, str(folder / "model.safetensors"))
    before = sorted((p.name, p.stat().st_size) for p in folder.iterdir())
    assert cli(["verify", str(folder)]) == 1
    assert f"{folder} {said}" in capsys.readouterr().out
    assert cli(["inspect", str(folder)]) == 2
    assert f"{folder} {said}" in capsys.readouterr().err
    assert cli(["reshard", str(folder), "-tp", "1", "-o", str(tmp_path / "out")]) == 2
    assert f"{folder} {said}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert sorted((p.name, p.stat().st_size) for p in folder.iterdir()) == before


@pytest.mark.parametrize("kind", ["missing", "file", "fifo", "dangling link", "under a file"])
def test_inspect_and_reshard_of_a_path_that_is_no_folder_say_so_not_an_incomplete_checkpoint(
    checkpoint, tmp_path, capsys, kind
):
    """A mistyped path, a file, a FIFO or a link to nothing given as the checkpoint: ``inspect`` and
    ``reshard`` said it had no manifest, "not a checkpoint ... (or an incomplete one)", as of a folder
    whose save had not finished; they now say what the path is, what was expected and to check it.
    Nothing is written (the output of the reshard is not made)."""
    import os

    path = tmp_path / "typo"
    if kind == "file":
        path.write_text("the user's")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "under a file":
        (tmp_path / "notes.txt").write_text("the user's")
        path = tmp_path / "notes.txt" / "sub"
    what = {
        "missing": "does not exist",
        "file": "is a file",
        "fifo": "is a FIFO",
        "dangling link": "is a link to nothing",
        "under a file": "cannot be read as a folder (Not a directory)",
    }[kind]
    said = (
        f"vllm-sharded: error: {path} {what}, where a checkpoint folder (the one that holds {MANIFEST_NAME}) was "
        "expected; check the path.\n"
    )
    assert cli(["inspect", str(path)]) == 2
    assert capsys.readouterr().err == said
    assert cli(["reshard", str(path), "-tp", "1", "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["reshard", "convert", "verify"])
def test_an_empty_path_is_refused_and_nothing_lands_in_the_working_folder(
    checkpoint, tmp_path, monkeypatch, capsys, command
):
    """``-o "$OUT"`` with OUT unset: an empty path was the working folder, and reshard wrote its
    checkpoint there (with --overwrite it would have removed part-named files there)."""
    _, directory = checkpoint
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    args = {
        "reshard": ["reshard", str(directory), "-tp", "1", "-o", ""],
        "convert": ["convert", str(directory), "-tp", "1", "-o", ""],
        "verify": ["verify", ""],
    }[command]
    with pytest.raises(SystemExit) as exited:
        cli(args)
    assert exited.value.code == 2
    assert "an empty path names no folder" in capsys.readouterr().err
    assert list(here.iterdir()) == []


def test_inspect_shows_experts_cut_across_tp_and_dp(tmp_path, capsys):
    from tests.support.checkpoints import save_flat

    save_flat(tmp_path, moe_weights(intermediate=32), 1, 2)
    assert cli(["inspect", str(tmp_path)]) == 0
    assert "experts       cut across TP x DP (2 ranks), written by each of 2 replicas" in capsys.readouterr().out


def test_verify_stopped_by_ctrl_c_says_it_changed_nothing(tmp_path):
    """Ctrl-C in ``verify`` (or ``inspect``), which only read, said what an interrupted reshard or
    convert leaves. The verify is frozen (SIGSTOP) once it has its part open, so that Ctrl-C lands
    inside it and not before or after."""
    import os
    import signal
    import time

    from tests.support.states import SOURCE
    from vllm_sharded_loader.checkpoint.save import save_checkpoint

    directory = tmp_path / "ckpt"
    big = {"w": torch.ones(64 * 2**20, dtype=torch.int32)}  # 256 MiB to hash: verify holds it open a while
    save_checkpoint(str(directory), {RankInfo(0, 1): big}, dtype="int32", source=SOURCE)
    (part,) = [f.name for f in read_manifest(str(directory)).ranks[0].files]
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "verify", str(directory)]
    running = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        deadline = time.monotonic() + 60
        while running.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # (a descriptor closed between the listing and the look)
                fds = os.listdir(f"/proc/{running.pid}/fd")
                if any(os.readlink(f"/proc/{running.pid}/fd/{fd}").endswith(part) for fd in fds):
                    running.send_signal(signal.SIGSTOP)
                    break
            time.sleep(0.0005)
        assert running.poll() is None, "verify ended before it could be interrupted; give it a larger part"
        running.send_signal(signal.SIGINT)
        running.send_signal(signal.SIGCONT)
        _, err = running.communicate(timeout=60)
    finally:
        running.kill()
    assert running.returncode == -signal.SIGINT, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "vllm-sharded: interrupted by SIGINT. verify only reads the checkpoint, which is as it was; run it again."
    )


@pytest.mark.parametrize(
    "name, overwrite",
    [("TERM", False), ("TERM", True), ("INT", False), ("INT", True), ("HUP", False)],
    ids=["TERM-new-output", "TERM-overwrite", "INT-new-output", "INT-overwrite", "HUP-new-output"],
)
def test_reshard_stopped_by_sigterm_sighup_or_ctrl_c_takes_back_what_it_wrote(checkpoint, tmp_path, name, overwrite):
    """``kill`` or a job scheduler's cancel (SIGTERM), or a closed terminal or ssh session (SIGHUP),
    stops a reshard as Ctrl-C does: one line naming the signal (no traceback), the process dead of
    that signal, and its output as it was: no folder made, or the checkpoint it would replace
    untouched, the user's file beside it kept, no lock or staged part left behind. The same command
    then succeeds without ``--overwrite``. (SIGTERM's and SIGHUP's default action had killed it on
    the spot: lock and staged parts stayed, and the next run was refused until asked to overwrite.)"""
    import os
    import signal

    from tests.support.faultkit import tree_digest
    from vllm_sharded_loader.storage import faults

    _, directory = checkpoint
    output = tmp_path / "out"
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "reshard", str(directory), "-tp", "4"]
    command += ["-o", str(output), "--max-file-size", "2048"]
    if overwrite:
        assert cli(command[3:]) == 0
        (output / "notes.txt").write_text("the user's")
    before = tree_digest(str(tmp_path))
    env = {**os.environ, faults.KILL_ENV: "local.staged:2", faults.KILL_SIGNAL_ENV: name}
    # (Ctrl-C's SIGINT reaches a command started in the background ignored, SIGHUP one started under
    # nohup: restored as a terminal has them.)
    stopped = subprocess.run(
        command + ["--overwrite"] * overwrite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP)],
    )
    assert stopped.returncode == -signal.Signals[f"SIG{name}"], stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines() == [
        f"vllm-sharded: interrupted by SIG{name}. An interrupted reshard or convert leaves its output as it was, or "
        "complete if it had published; run the command again."
    ]
    assert tree_digest(str(tmp_path)) == before
    # (Run again from the tests' package fork server: the same command, without a new interpreter.)
    again = package_process(command[1:], timeout=120)
    if overwrite:
        assert again.returncode == 2 and "already holds a checkpoint" in again.stderr, again.stderr
        again = package_process([*command[1:], "--overwrite"], timeout=120)
    assert again.returncode == 0, again.stderr
    assert cli(["verify", str(output)]) == 0
    manifest = read_manifest(str(output))
    listed = {f.name for r in manifest.ranks for f in r.files}
    extra = {"notes.txt"} if overwrite else set()
    assert set(os.listdir(output)) == listed | {MANIFEST_NAME} | extra


def test_reshard_stopped_once_it_has_published_says_the_checkpoint_is_complete(checkpoint, tmp_path, capsys):
    """SIGTERM (as Ctrl-C) once the new manifest is out: the lock and the replaced parts stay (the
    save stops there), but the new checkpoint is complete, so the line says that and what removes the
    leftovers, not to run the command again (which it said)."""
    import os
    import signal

    from vllm_sharded_loader.storage import faults

    _, directory = checkpoint
    output = tmp_path / "out"
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "reshard", str(directory), "-tp", "4"]
    command += ["-o", str(output), "--overwrite"]
    assert cli(["reshard", str(directory), "-tp", "1", "-o", str(output)]) == 0
    env = {**os.environ, faults.KILL_ENV: "local.published", faults.KILL_SIGNAL_ENV: "TERM"}
    stopped = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == -signal.SIGTERM, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines() == [
        f"vllm-sharded: interrupted by SIGTERM. The new checkpoint in {output} was published and is complete; "
        "nothing needs to run again. Its save lock and any parts it replaced remain (our loader ignores them): "
        "the next save into it with --overwrite removes them."
    ]
    assert read_manifest(str(output)).tp_size == 4 and (output / LOCK_NAME).exists()
    assert cli(["verify", str(output)]) == 0 and "OK:" in capsys.readouterr().out
    assert cli(command[3:]) == 0
    manifest = read_manifest(str(output))
    assert set(os.listdir(output)) == {f.name for r in manifest.ranks for f in r.files} | {MANIFEST_NAME}


def test_a_reshard_whose_source_is_saved_over_meanwhile_carries_nothing_of_the_new_save(checkpoint, tmp_path):
    """The source's carried files are checked before the reshard and copied under the output's lock,
    later: another save into the source that placed its tokenizer meanwhile (its old parts not yet
    removed) had the output carry the new save's tokenizer beside the old weights, recorded as
    sound. Now what is copied must be what the source's manifest records."""
    import os
    import signal
    import time
    from pathlib import Path

    from vllm_sharded_loader.storage import faults

    _, directory = checkpoint
    (directory / "tokenizer.json").write_text('{"model": "old"}')
    source, output = tmp_path / "source", tmp_path / "out"
    assert cli(["reshard", str(directory), "-tp", "1", "-o", str(source)]) == 0  # records the tokenizer
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "reshard", str(source), "-tp", "2"]
    env = {**os.environ, faults.KILL_ENV: "local.staged", faults.KILL_SIGNAL_ENV: "STOP"}
    with subprocess.Popen([*command, "-o", str(output)], env=env, stderr=subprocess.PIPE, text=True) as saving:
        try:
            deadline = time.monotonic() + 120
            stat = Path(f"/proc/{saving.pid}/stat")
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":  # stopped, its checks passed
                assert saving.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            placed = source / ".tokenizer.json.another-save"
            placed.write_text('{"model": "new"}')
            os.replace(placed, source / "tokenizer.json")  # as a save places a carried file
        finally:
            saving.send_signal(signal.SIGCONT)
        _, err = saving.communicate(timeout=120)
    assert saving.returncode == 2, err[-2000:]
    assert f"{source}: tokenizer.json no longer as its manifest records" in err, err[-2000:]
    assert not (output / "sharded_state.json").exists() and not (output / "tokenizer.json").exists()


def test_inspect_and_reshard_of_a_folder_whose_first_save_runs_name_the_save(checkpoint, tmp_path, capsys):
    """A folder that a reshard (another process, stopped mid-write) is saving for the first time:
    inspect, and a reshard from it, say that a save holds it, who, and to wait, as verify does (they
    said "no sharded_state.json: not a checkpoint"); once that save finishes, inspect shows it."""
    import os
    import signal
    import time
    from pathlib import Path

    from vllm_sharded_loader.storage import faults

    _, directory = checkpoint
    output = tmp_path / "being-saved"
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "reshard", str(directory), "-tp", "4"]
    env = {**os.environ, faults.KILL_ENV: "local.staged", faults.KILL_SIGNAL_ENV: "STOP"}
    with subprocess.Popen([*command, "-o", str(output)], env=env, stdout=subprocess.DEVNULL) as saving:
        try:
            deadline = time.monotonic() + 120
            stat = Path(f"/proc/{saving.pid}/stat")
            while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":  # stopped at its kill point
                assert saving.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
            held = rf"{re.escape(str(output))} is being saved or its save was interrupted: .*\(pid {saving.pid} "
            held += ".*Wait for the save to finish"
            assert cli(["inspect", str(output)]) == 2
            assert re.search(held, capsys.readouterr().err)
            assert cli(["reshard", str(output), "-tp", "2", "-o", str(tmp_path / "from-it")]) == 2
            assert re.search(held, capsys.readouterr().err) and not (tmp_path / "from-it").exists()
        finally:
            saving.send_signal(signal.SIGCONT)
        assert saving.wait(timeout=120) == 0
    assert cli(["inspect", str(output)]) == 0 and "TP=4 PP=1" in capsys.readouterr().out
