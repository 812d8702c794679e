"""The command line at a user's terminal (issue 52 item 4): ``ls`` and ``inspect`` fit 80 columns
with every step number whole; each error says what to do next (the steps there are, the closest
key, ``import`` for another system's checkpoint, ``--step`` for a step already committed);
``verify`` prints an error once on a terminal; ``gc --dry-run`` deletes nothing; the AWS SDK's log
stays out of stderr unless asked. Each with its control.
"""
from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

import ckptfmt
from ckptfmt_tools.cli import app
from ckptfmt_tools.cli._quiet import is_aws_line
from ckptfmt_tools.cli._render import middle_ellipsis

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
KEY = "model/layers/0/attention/q_proj/kernel"


@pytest.fixture
def repo(tmp_path) -> str:
    """Three steps of a two-tensor state."""
    url = str(tmp_path / "repo")
    for step in (1, 2, 3):
        w = np.arange(64, dtype=np.float32).reshape(16, 4) * step
        shards = [ckptfmt.LocalShard(k, w.shape, w.dtype, ckptfmt.Box.full(w.shape), w) for k in (KEY, "opt/mu/w")]
        ckptfmt.save(url, step, shards, state={"step": step})
    return url


def _lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip()]


def test_ls_fits_80_columns_with_whole_step_numbers(repo, monkeypatch):
    ids = [r["save_id"] for r in json.loads(runner.invoke(app, ["ls", repo, "--json"]).stdout)["steps"]]
    monkeypatch.setenv("COLUMNS", "80")
    out = runner.invoke(app, ["ls", repo]).stdout
    assert max(cell_len(line) for line in _lines(out)) <= 80, out
    rows = [line.split("│") for line in out.splitlines() if line.startswith("│")]
    assert [r[1].strip() for r in rows] == ["1", "2", "3"], out  # the step column, whole
    shown = [r[-2].strip() for r in rows]
    for sid, cell in zip(ids, shown):  # the save id loses its middle, never its ends
        head, _, tail = cell.partition("…")
        assert _ and sid.startswith(head) and sid.endswith(tail) and len(cell) < len(sid), (sid, cell)
    assert "ckptfmt ls --json shows all" in out
    monkeypatch.setenv("COLUMNS", "200")  # control: a wide terminal shows every column and whole ids
    wide = runner.invoke(app, ["ls", repo]).stdout
    assert all(sid in wide for sid in ids) and "…" not in wide and "referenced" in wide and "hidden" not in wide


def test_inspect_fits_80_columns(repo, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = runner.invoke(app, ["inspect", repo]).stdout
    assert max(cell_len(line) for line in _lines(out)) <= 80, out
    cells = "".join(line.split("│")[1].strip() for line in out.splitlines() if line.count("│") > 2)
    assert KEY in cells and "opt/mu/w" in cells  # key paths wrap, never cut
    assert middle_ellipsis("0123456789", 10) == "0123456789" and middle_ellipsis("0123456789", 7) == "01…6789"


def test_a_missing_step_lists_the_steps_there_are(repo):
    for command in (["inspect", repo, "--step", "7"], ["verify", repo, "--step", "7"], ["show", repo, "opt/mu/w", "--step", "7"]):
        r = runner.invoke(app, [*command, "--json"])
        doc = json.loads(r.stdout)
        message = doc["message"] if "message" in doc else doc["steps"][0]["message"]
        assert r.exit_code == 1 and "committed steps are 1, 2, 3" in message, (command, r.stdout)
    assert runner.invoke(app, ["inspect", repo, "--step", "2"]).exit_code == 0  # control


def test_a_mistyped_key_gets_the_closest_one(repo):
    r = runner.invoke(app, ["show", repo, "opt/mu/ww", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["error"] == "KeyMismatchError" and "did you mean 'opt/mu/w'?" in doc["message"]
    r = runner.invoke(app, ["show", repo, "zzzz", "--json"])  # control: nothing close, no guess
    assert r.exit_code == 1 and "did you mean" not in json.loads(r.stdout)["message"]
    assert runner.invoke(app, ["show", repo, "opt/mu/w"]).exit_code == 0


@pytest.mark.parametrize("marker, fmt", [(".metadata", "dcp"), ("_CHECKPOINT_METADATA", "orbax"),
                                         ("model.safetensors.index.json", "safetensors")])
def test_another_systems_checkpoint_is_pointed_to_import(tmp_path, marker, fmt):
    src = tmp_path / "foreign"
    src.mkdir()
    (src / marker).write_bytes(b"x")
    doc = json.loads(runner.invoke(app, ["ls", str(src), "--json"]).stdout)
    assert doc["error"] == "NotARepositoryError" and f"ckptfmt import --from {fmt} {src}" in doc["message"], doc
    (tmp_path / "empty").mkdir()  # control: an empty folder is not called a checkpoint
    doc = json.loads(runner.invoke(app, ["ls", str(tmp_path / "empty"), "--json"]).stdout)
    assert doc["error"] == "NotARepositoryError" and "import" not in doc["message"]


def test_import_into_a_committed_step_suggests_another(repo, tmp_path):
    from safetensors.numpy import save_file

    src = str(tmp_path / "x.safetensors")
    save_file({"a": np.ones((2, 2), np.float32)}, src)
    r = runner.invoke(app, ["import", src, repo, "--from", "safetensors", "--step", "3", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["error"] == "StepAlreadyCommittedError" and "--step 4" in doc["message"], doc
    r = runner.invoke(app, ["import", src, repo, "--from", "safetensors", "--step", "4", "--json"])  # control
    assert r.exit_code == 0 and json.loads(r.stdout)["report"]["step"] == 4


def test_gc_dry_run_deletes_nothing_and_lists_what_a_run_removes(repo):
    before = sorted(p.relative_to(repo) for p in Path(repo).rglob("*"))
    r = runner.invoke(app, ["gc", repo, "--keep-last", "1", "--dry-run", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0 and doc["report"]["dry_run"] and doc["report"]["removed_steps"] == [1, 2], doc
    after = sorted(p.relative_to(repo) for p in Path(repo).rglob("*"))
    # Nothing deleted; the one object it may add is the newest step's verification record (FORMAT.md
    # 10.4), which retention's byte-for-byte check of the step it keeps leaves, as any verify does.
    assert set(before) <= set(after) and {p.name for p in set(after) - set(before)} <= {"VERIFIED"}, (before, after)
    human = runner.invoke(app, ["gc", repo, "--keep-last", "1", "--dry-run"]).stdout
    assert "steps to remove" in human and "nothing was deleted" in human
    r = runner.invoke(app, ["gc", repo, "--keep-last", "1", "--json"])  # control: the run removes those
    assert r.exit_code == 0 and json.loads(r.stdout)["report"]["removed_steps"] == [1, 2]
    assert json.loads(runner.invoke(app, ["ls", repo, "--json"]).stdout)["steps"][0]["step"] == 3


def _on_a_terminal(args: list[str]) -> tuple[int, str]:
    """``python -m ckptfmt ARGS`` with stdout and stderr on one pseudo-terminal: what a user sees."""
    main, sub = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="120")
    p = subprocess.Popen([sys.executable, "-m", "ckptfmt", *args], stdin=subprocess.DEVNULL, stdout=sub, stderr=sub,
                         env=env, close_fds=True)
    os.close(sub)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main)
    return p.wait(timeout=120), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))


def test_verify_prints_each_error_once_on_a_terminal(repo):
    code, screen = _on_a_terminal(["verify", repo, "--step", "7"])
    assert code == 1 and screen.count("StepNotFoundError") == 1, screen
    # Control: with stdout piped, the table goes to the pipe and stderr still says it once.
    p = subprocess.run([sys.executable, "-m", "ckptfmt", "verify", repo, "--step", "7"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 1 and p.stderr.count("StepNotFoundError") == 1 and "StepNotFoundError" in p.stdout


def test_the_aws_sdk_log_is_left_out_unless_asked(tmp_path):
    """A line from an AWS log subject is dropped and every other line of descriptor 2 kept, in a
    real process; ``CKPTFMT_AWS_LOG=1`` keeps them all (the control)."""
    aws = "E1206 20:10:40.929114   10982 common-io:5] static: Failed to open file. path:'~/.aws/config'"
    ours = "E1206 20:10:40.929114   10982 kvstore.cc:88] a tensorstore line"
    code = ("import os, sys\nfrom ckptfmt_tools.cli._quiet import quiet_aws_log\nwith quiet_aws_log():\n"
            f"    os.write(2, {(aws + chr(10) + ours + chr(10) + 'plain' + chr(10)).encode()!r})\n"
            "    print('python stderr', file=sys.stderr)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("CKPTFMT_AWS_LOG", None)
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert quiet.returncode == 0 and "common-io" not in quiet.stderr, quiet.stderr
    assert "a tensorstore line" in quiet.stderr and "plain" in quiet.stderr and "python stderr" in quiet.stderr
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(env, CKPTFMT_AWS_LOG="1"), timeout=60)
    assert "common-io" in loud.stderr and "plain" in loud.stderr
    assert is_aws_line(aws.encode()) and not is_aws_line(ours.encode()) and not is_aws_line(b"plain")


def test_bench_is_marked_for_developers():
    out = runner.invoke(app, ["--help"]).stdout
    assert "bench is for ckptfmt's developers" in out
    assert out.index("drill") < out.index("  bench")  # listed after every user command


def test_the_command_line_keeps_the_aws_log_out_of_an_s3_error(tmp_path):
    """End to end: ``ckptfmt ls s3://...`` with no credentials file and a closed endpoint. The AWS
    SDK logs its failed credentials lookup; the user sees the StorageError with what to check next,
    and none of the SDK's lines. Control: CKPTFMT_AWS_LOG=1 shows them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_REGION="us-east-1",
               PYTHONPATH=str(ROOT))
    env.pop("CKPTFMT_AWS_LOG", None)
    run = [sys.executable, "-m", "ckptfmt", "ls", "s3://nobucket/x"]
    quiet = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 1 and "StorageError" in quiet.stderr and "endpoint" in quiet.stderr, quiet.stderr
    assert "AuthCredentialsProvider" not in quiet.stderr and "common-io" not in quiet.stderr, quiet.stderr
    loud = subprocess.run(run, capture_output=True, text=True, env=dict(env, CKPTFMT_AWS_LOG="1"), timeout=120)
    assert loud.returncode == 1 and "AuthCredentialsProvider" in loud.stderr and "StorageError" in loud.stderr
