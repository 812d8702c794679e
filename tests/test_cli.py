"""The ckptfmt command line: ls, inspect, verify, gc, faults, and the pass-through commands."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import ckptfmt
from ckptfmt._types import Box, LocalShard
from ckptfmt_tools.cli import app
from ckptfmt_tools.faults import _data
from ckptfmt_tools.faults._scene import Scene, flip

runner = CliRunner()
SEED = 11


def _save(url: str, step: int) -> None:
    ckptfmt.save(url, step, _data.local_shards(SEED, step, 0, 1), state=_data.global_state(SEED, step),
                 rank_state=_data.rank_state(SEED, step, 0),
                 options=ckptfmt.SaveOptions(chunk_target_bytes=_data.CHUNK_TARGET_BYTES))


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    for step in (10, 20):
        _save(str(root), step)
    return root


def _json(args: list[str]) -> tuple[int, dict]:
    r = runner.invoke(app, args)
    return r.exit_code, json.loads(r.stdout)


def test_ls_table_and_json(repo):
    r = runner.invoke(app, ["ls", str(repo)])
    assert r.exit_code == 0, r.output
    assert "committed steps" in r.stdout and "10" in r.stdout and "20" in r.stdout
    code, doc = _json(["ls", str(repo), "--json"])
    assert code == 0 and doc["ok"]
    assert [s["step"] for s in doc["steps"]] == [10, 20]
    m = ckptfmt.Repository(str(repo)).manifest(20)
    assert doc["steps"][1]["bytes"] == m.nbytes and doc["steps"][1]["save_id"] == m.save_id
    assert doc["steps"][1]["created_unix"] == m.created_unix


def test_inspect_lists_tensors_and_state_keys(repo):
    code, doc = _json(["inspect", str(repo), "--step", "10", "--json"])
    assert code == 0 and doc["step"] == 10
    by_key = {t["key"]: t for t in doc["tensors"]}
    assert set(by_key) == set(_data.TENSORS)
    k = by_key["params/dense/kernel"]
    assert k["shape"] == [64, 32] and k["dtype"] == "float32" and k["bytes"] == 64 * 32 * 4 and k["shards"] >= 1
    assert doc["state_keys"] == sorted(_data.global_state(SEED, 10))
    r = runner.invoke(app, ["inspect", str(repo)])  # default: latest
    assert r.exit_code == 0 and "step 20" in r.stdout and "params/dense/kernel" in r.stdout
    assert "loader" in r.stdout


def test_verify_clean_and_all(repo):
    r = runner.invoke(app, ["verify", str(repo)])
    assert r.exit_code == 0, r.output
    code, doc = _json(["verify", str(repo), "--all", "--json"])
    assert code == 0 and [s["step"] for s in doc["steps"]] == [10, 20] and all(s["ok"] for s in doc["steps"])
    assert doc["steps"][0]["bytes"] == ckptfmt.Repository(str(repo)).manifest(10).nbytes


def test_verify_names_the_typed_error(repo):
    scene = Scene(repo, SEED)
    flip(scene.shard_path(20, shard=0), scene.shard_layout(20, shard=0)["chunk0_offset"] + 8, 64)
    r = runner.invoke(app, ["verify", str(repo), "--step", "20"])
    assert r.exit_code == 1
    assert "ChecksumMismatchError" in r.output and "params/dense/kernel" in r.output
    code, doc = _json(["verify", str(repo), "--all", "--json"])
    assert code == 1 and not doc["ok"]
    bad = doc["steps"][1]
    assert doc["steps"][0]["ok"] and bad["error"] == "ChecksumMismatchError" and bad["key"] == "params/dense/kernel"
    assert bad["expected"] is not None and bad["found"] is not None and "/p/" in bad["object"]  # its pack (FORMAT.md 5.15)


def test_verify_missing_step_and_bad_url(tmp_path, repo):
    code, doc = _json(["verify", str(repo), "--step", "99", "--json"])
    assert code == 1 and doc["steps"][0]["error"] == "StepNotFoundError"
    code, doc = _json(["ls", "nosuch://x", "--json"])
    assert code == 1 and doc["error"] == "InvalidURLError" and doc["object"] == "nosuch://x"
    r = runner.invoke(app, ["verify", str(repo), "--step", "1", "--all"])
    assert r.exit_code == 2


# ------------------------------------------------------------------ a path that holds no repository

def _made(path: Path, files: dict[str, str] | None = None, dirs: tuple[str, ...] = ()) -> Path:
    path.mkdir(parents=True)
    for d in dirs:
        (path / d).mkdir(parents=True)
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


NOT_A_REPO = {
    "absent": lambda d: d / "no" / "such" / "dir",
    "empty directory": lambda d: _made(d / "empty"),
    "a home with a saves/ folder": lambda d: _made(d / "home", dirs=("saves/photos",)),
    "a marker of another format": lambda d: _made(d / "m", {"ckptfmt.json": '{"format":"zarr"}'}),
}
READERS = {"ls": [], "inspect": [], "inspect --step": ["--step", "3"], "verify": [], "verify --all": ["--all"],
           "verify --step": ["--step", "3"], "gc": ["--grace-s", "0"], "export": ["OUT"]}


@pytest.mark.parametrize("place", sorted(NOT_A_REPO))
@pytest.mark.parametrize("command", sorted(READERS))
def test_every_reading_command_says_the_path_is_not_a_repository(tmp_path, place, command):
    """Issue 24 item 12: never "no committed steps" (exit 0) for a path that holds no repository."""
    url = str(NOT_A_REPO[place](tmp_path))
    extra = [str(tmp_path / "out") if a == "OUT" else a for a in READERS[command]]
    args = [command.split()[0], url, *extra]
    code, doc = _json(args + ["--json"])
    assert code == 1 and doc["ok"] is False and doc["error"] == "NotARepositoryError" and doc["object"] == url
    r = runner.invoke(app, args)
    assert r.exit_code == 1 and "NotARepositoryError" in r.output and "no ckptfmt repository" in r.output
    assert not (tmp_path / "out").exists()  # export touched nothing


def test_an_empty_repository_is_still_a_repository(tmp_path):
    """Control: a repository with its marker and no step (a first save that died before its
    commit) keeps today's answers: ``ls`` lists no step and exits 0, ``verify --all`` checks none
    and exits 0, ``inspect`` and ``verify`` of the latest step exit 1 with StepNotFoundError."""
    root = tmp_path / "r"
    root.mkdir()
    (root / "ckptfmt.json").write_bytes(ckptfmt.manifest.MARKER_BYTES)
    code, doc = _json(["ls", str(root), "--json"])
    assert code == 0 and doc["ok"] and doc["steps"] == []
    r = runner.invoke(app, ["ls", str(root)])
    assert r.exit_code == 0 and "no committed steps" in r.output
    code, doc = _json(["verify", str(root), "--all", "--json"])
    assert code == 0 and doc["steps"] == []
    for args in (["inspect", str(root)], ["verify", str(root)], ["verify", str(root), "--step", "3"]):
        code, doc = _json(args + ["--json"])
        assert code == 1, args
        assert (doc.get("error") or doc["steps"][0]["error"]) == "StepNotFoundError", args


def test_a_repository_from_before_the_marker_is_recognised_by_a_valid_manifest(repo):
    (repo / "ckptfmt.json").unlink()
    code, doc = _json(["ls", str(repo), "--json"])
    assert code == 0 and [s["step"] for s in doc["steps"]] == [10, 20]
    assert runner.invoke(app, ["verify", str(repo), "--all"]).exit_code == 0
    # Broken control: with no manifest that validates, it is not a repository.
    for step in (10, 20):
        Scene(repo, SEED).manifest_path(step).write_text("{not json")
    code, doc = _json(["ls", str(repo), "--json"])
    assert code == 1 and doc["error"] == "NotARepositoryError" and "2 manifest name(s)" in doc["found"]


def test_ls_shows_an_unreadable_manifest(repo):
    Scene(repo, SEED).manifest_path(20).write_text("{not json")
    code, doc = _json(["ls", str(repo), "--json"])
    assert code == 1 and doc["steps"][1]["error"] == "InvalidManifestError" and doc["steps"][0]["step"] == 10


def test_gc_retention_and_leftovers(repo):
    (repo / "saves" / "000000000030-20000101T000000-deadbeef" / "t").mkdir(parents=True)
    (repo / "saves" / "000000000030-20000101T000000-deadbeef" / "t" / "zarr.json").write_text("{}")
    code, doc = _json(["gc", str(repo), "--keep-last", "1", "--grace-s", "0", "--json"])
    assert code == 0
    assert doc["report"]["removed_steps"] == [10]
    assert "000000000030-20000101T000000-deadbeef" in doc["report"]["removed_saves"]
    assert ckptfmt.Repository(str(repo)).steps() == [20]
    assert runner.invoke(app, ["verify", str(repo)]).exit_code == 0


def test_stray_manifest_names_are_reported_not_listed(repo):
    """Issue 12, item 12: a 20-digit name above 2^63-1 is not a step; ls/verify name it as foreign."""
    import shutil

    m = repo / "manifests"
    shutil.copyfile(m / f"{20:020d}.json", m / "99999999999999999999.json")
    (m / "notes.txt").write_text("x")
    code, doc = _json(["ls", str(repo), "--json"])
    assert code == 0 and [s["step"] for s in doc["steps"]] == [10, 20]
    assert doc["foreign"] == ["manifests/99999999999999999999.json", "manifests/notes.txt"]
    code, doc = _json(["verify", str(repo), "--json"])  # verifies the latest: 20, not the stray name
    assert code == 0 and [s["step"] for s in doc["steps"]] == [20] and len(doc["foreign"]) == 2
    r = runner.invoke(app, ["ls", str(repo)])
    assert r.exit_code == 0 and "99999999999999999999" in r.stdout and "not steps" in r.stdout
    # Control: the same bytes under a valid step name are a step (and fail its step check).
    shutil.copyfile(m / f"{20:020d}.json", m / f"{30:020d}.json")
    code, doc = _json(["ls", str(repo), "--json"])
    assert code == 1 and [s["step"] for s in doc["steps"]] == [10, 20, 30]
    assert doc["steps"][2]["error"] == "InvalidManifestError"


def test_gc_reports_foreign_objects_and_problems(repo):
    (repo / "saves" / ".DS_Store").write_bytes(b"Bud1")
    code, doc = _json(["gc", str(repo), "--grace-s", "0", "--json"])  # control: no damaged step, exit 0
    assert code == 0 and doc["ok"] and doc["report"]["damaged_steps"] == []
    Scene(repo, SEED).manifest_path(10).write_text("{not json")
    code, doc = _json(["gc", str(repo), "--grace-s", "0", "--json"])
    # A damaged manifest is reported, kept, and makes gc exit 1 (issue 52: it said "ok" before).
    assert code == 1 and not doc["ok"] and doc["report"]["foreign"] == ["saves/.DS_Store"]
    assert doc["report"]["damaged_steps"] == [10] and Scene(repo, SEED).manifest_path(10).exists()
    assert (repo / "saves" / ".DS_Store").exists()
    r = runner.invoke(app, ["gc", str(repo), "--grace-s", "0"])
    assert r.exit_code == 1 and ".DS_Store" in r.stdout and "verify" in r.stderr and "--step 10" in r.stderr
    # Not a repository: nothing deleted, exit 1 with the typed error.
    home = repo.parent / "home"
    (home / "saves" / "photos").mkdir(parents=True)
    (home / "saves" / "photos" / "a.jpg").write_bytes(b"jpg")
    code, doc = _json(["gc", str(home), "--grace-s", "0", "--json"])
    assert code == 1 and doc["error"] == "NotARepositoryError"
    assert (home / "saves" / "photos" / "a.jpg").exists()


def test_faults_list(repo):
    code, doc = _json(["faults", "--list", "--json"])
    assert code == 0 and {f["name"] for f in doc["faults"]} >= {"shard-missing", "disk-full"}


def test_faults_one_row_json(tmp_path):
    code, doc = _json(["faults", "--only", "data-64-bytes", "--workdir", str(tmp_path), "--json"])
    assert code == 0 and doc["all_passed"]
    (row,) = doc["outcomes"]
    assert row["fault"] == "data-64-bytes" and row["raised"][0] == "ChecksumMismatchError"
    assert row["state_exposed"] is False and row["prior_intact"] is True


def test_faults_only_takes_a_comma_list_and_names_the_closest_fault(tmp_path):
    """``--only a,b`` runs both rows (as ``--only a --only b`` does); a misspelt name is a usage
    error (exit 2) suggesting the closest fault, before anything runs."""
    code, doc = _json(["faults", "--only", "data-64-bytes,coop-transit-flip", "--workdir", str(tmp_path), "--json"])
    assert code == 0 and [r["fault"] for r in doc["outcomes"]] == ["data-64-bytes", "coop-transit-flip"]
    r = CliRunner().invoke(app, ["faults", "--only", "coop-transit-flp"])
    assert r.exit_code == 2 and "did you mean coop-transit-flip" in r.output


@pytest.mark.parametrize("command,module,args,want", [
    ("demo", "ckptfmt_tools.demo", ["--k", "4", "--json"], ["--k", "4", "--json"]),
    ("bench", "ckptfmt_tools.bench.args", ["-r", "2", "--size", "1G", "--no-steady", "--json"],
     ["--size", "1G", "--repetitions", "2", "--no-steady", "--json"]),
    ("bench", "ckptfmt_tools.bench.args", ["--incremental", "--saves", "3"], ["--incremental", "--saves", "3"]),
    ("drill", "ckptfmt_tools.drill", ["--out", "d", "--no-control", "--seed", "5"],
     ["--out", "d", "--seed", "5", "--no-control"]),
])
def test_run_commands_forward_the_options_given(command, module, args, want, monkeypatch):
    seen = {}
    fake = types.ModuleType(module)
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, module, fake)
    r = runner.invoke(app, [command, *args])
    assert r.exit_code == 0, r.output
    assert seen["argv"] == want  # only what was given: the module's defaults apply to the rest
    # Broken controls: an unknown option and an option of another mode are usage errors (exit 2).
    assert runner.invoke(app, [command, "--no-such-option"]).exit_code == 2
    assert runner.invoke(app, ["bench", "--saves", "3"]).exit_code == 2


def test_run_command_exit_code(monkeypatch):
    fake = types.ModuleType("ckptfmt_tools.drill")
    fake.main = lambda argv: 3
    monkeypatch.setitem(sys.modules, "ckptfmt_tools.drill", fake)
    assert runner.invoke(app, ["drill"]).exit_code == 3


def _options(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def test_run_commands_declare_every_option_of_their_runners():
    from typer.main import get_command

    from ckptfmt_tools import demo
    from ckptfmt_tools.bench import args as bench_args, incremental
    from ckptfmt_tools.drill import _config

    group = get_command(app)

    def declared(name: str) -> set[str]:
        return {o for p in group.commands[name].params for o in p.opts} - {"--help"}

    assert _options(demo.parser()) == declared("demo")
    assert _options(_config.parser()) == declared("drill")
    compression = {"--compression", "--size", "--levels", "--json"}
    assert "--json" in _options(bench_args.build_parser())  # the bench itself, not only its other modes
    assert _options(bench_args.build_parser()) | _options(incremental._parser()) | compression == declared("bench")


def test_help_shows_flags_as_flags():
    for cmd in (["ls", "--help"], ["bench", "--help"], ["drill", "--help"], ["inspect", "--help"]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 0 and "--json" in r.stdout, r.output
        assert "<bool>" not in r.stdout, r.stdout
    assert "--step <int>" in runner.invoke(app, ["inspect", "--help"]).stdout  # control: values still show a type


def test_python_dash_m_entry_point(repo):
    out = subprocess.run([sys.executable, "-m", "ckptfmt", "ls", str(repo), "--json"], capture_output=True,
                         text=True, timeout=60, cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    assert [s["step"] for s in json.loads(out.stdout)["steps"]] == [10, 20]


# ------------------------------------------------------------- hostile strings (issue 12, item 15)
OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"      # write "rm -rf ~" to the clipboard
CLEAR = "\x1b[2J\x1b[H"                   # clear the screen
BIDI = "\u202e"                           # right-to-left override
HOSTILE_KEY = f"params/{OSC52}{CLEAR}{BIDI}[bold red]x[/bold red]\x9b/w"
RAW = ("\x1b", "\x07", "\x9b", BIDI)


def _hostile_repo(root: Path) -> Path:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    shards = [LocalShard(HOSTILE_KEY, (2, 3), x.dtype, Box.full((2, 3)), x)]
    ckptfmt.save(str(root), 5, shards, state={f"cursor{CLEAR}[link=http://x]y": 1},
                 metadata={"note": OSC52})
    return root


def test_safe_escapes_controls_bidi_and_markup():
    from rich.console import Console

    from ckptfmt_tools.cli._render import safe

    def shown(text: str) -> str:
        c = Console(record=True, width=400, highlight=False, file=io.StringIO())
        c.print(text)
        return c.export_text()

    out = shown(safe(HOSTILE_KEY))
    assert not any(ch in out for ch in RAW)
    assert "\\x1b]52;c;" in out and "\\x07" in out and "\\x9b" in out and "\\u202e" in out
    assert "[bold red]x[/bold red]" in out  # printed as text, not as markup
    assert shown(safe("a\\x1b")) == "a\\\\x1b\n"  # a literal backslash cannot forge an escape
    assert shown(safe("a\\[red]b")) == "a\\\\[red]b\n"
    assert shown(safe("naïve 数据 ok")) == "naïve 数据 ok\n"  # printable text is left alone
    # Broken control: printed as is, the escapes reach the output and the markup is consumed.
    raw = shown(HOSTILE_KEY)
    assert "\x1b" in raw and BIDI in raw and "[bold red]" not in raw


def test_hostile_key_paths_are_escaped_in_every_human_output(tmp_path):
    repo = _hostile_repo(tmp_path / "repo")
    outputs = {}
    wide = {"COLUMNS": "400"}  # no wrapping inside the strings looked for below
    for args in (["ls", str(repo)], ["inspect", str(repo)], ["verify", str(repo)]):
        r = runner.invoke(app, args, env=wide)
        assert r.exit_code == 0, r.output
        outputs[args[0]] = r.output
    scene = Scene(repo, SEED)
    flip(scene.shard_path(5, HOSTILE_KEY, 0), scene.shard_layout(5, HOSTILE_KEY, 0)["chunk0_offset"] + 1, 1)
    r = runner.invoke(app, ["verify", str(repo)], env=wide)
    assert r.exit_code == 1 and "ChecksumMismatchError" in r.output
    outputs["verify-error"] = r.output
    for name, out in outputs.items():
        assert not any(ch in out for ch in RAW), name
    for name in ("inspect", "verify-error"):
        assert "\\x1b]52;c;" in outputs[name] and "[bold red]x[/bold red]" in outputs[name], name
    assert "cursor\\x1b[2J\\x1b[H[link=http://x]y" in outputs["inspect"]
    # JSON keeps the strings exact (json.dumps escapes them), and ok agrees with the exit code.
    code, doc = _json(["verify", str(repo), "--json"])
    assert code == 1 and doc["ok"] is False and doc["steps"][0]["key"] == HOSTILE_KEY
    code, doc = _json(["inspect", str(repo), "--json"])
    assert code == 0 and doc["ok"] is True
    assert doc["tensors"][0]["key"] == HOSTILE_KEY and doc["metadata"] == {"note": OSC52}
    assert doc["state_keys"] == [f"cursor{CLEAR}[link=http://x]y"]
    out = runner.invoke(app, ["inspect", str(repo), "--json"]).stdout
    assert not any(ch in out for ch in RAW)


def test_json_ok_agrees_with_the_exit_code(repo, tmp_path):
    Scene(repo, SEED).manifest_path(20).write_text("{not json")
    code, doc = _json(["ls", str(repo), "--json"])
    assert (code, doc["ok"]) == (1, False)
    code, doc = _json(["verify", str(repo), "--step", "10", "--json"])
    assert (code, doc["ok"]) == (0, True)  # the control: the same repository, a clean step
    code, doc = _json(["verify", str(repo), "--step", "20", "--json"])
    assert (code, doc["ok"]) == (1, False)
    code, doc = _json(["ls", str(tmp_path / "absent"), "--json"])  # no repository (issue 24 item 12)
    assert (code, doc["ok"], doc["error"]) == (1, False, "NotARepositoryError")
    _made(tmp_path / "empty", {"ckptfmt.json": ckptfmt.manifest.MARKER_BYTES.decode()})
    code, doc = _json(["ls", str(tmp_path / "empty"), "--json"])  # a repository with no step
    assert (code, doc["ok"]) == (0, True)
    code, doc = _json(["faults", "--list", "--json"])
    assert (code, doc["ok"]) == (0, True)
    code, doc = _json(["ls", "file:/abs", "--json"])
    assert (code, doc["ok"], doc["error"]) == (1, False, "InvalidURLError")


def test_ls_inspect_verify_show_written_and_referenced_bytes(tmp_path):
    root = tmp_path / "inc"
    base = np.arange(256, dtype=np.float32).reshape(16, 16)
    for step in (1, 2):
        adapter = np.full(4, step, np.float32)
        ckptfmt.save(str(root), step, [LocalShard("base", base.shape, base.dtype, Box.full(base.shape), base),
                                       LocalShard("adapter", (4,), np.float32, Box.full((4,)), adapter)])
    repo = ckptfmt.Repository(str(root))
    m1, m2 = repo.manifest(1), repo.manifest(2)
    code, doc = _json(["ls", str(root), "--json"])
    assert code == 0
    one, two = doc["steps"]
    assert one["referenced_bytes"] == 0 and one["written_bytes"] == one["bytes"] == m1.nbytes
    assert two["referenced_bytes"] == int(m1.tensors["base"].shards.nbytes.sum()) > 0
    assert two["written_bytes"] + two["referenced_bytes"] == two["bytes"] and two["references"] == [m1.save_id]
    code, doc = _json(["inspect", str(root), "--json"])
    assert doc["referenced_bytes"] == two["referenced_bytes"] and doc["references"] == [m1.save_id]
    by_key = {t["key"]: t for t in doc["tensors"]}
    assert by_key["base"]["referenced_bytes"] > 0 and by_key["adapter"]["referenced_bytes"] == 0
    r = runner.invoke(app, ["inspect", str(root)])
    assert r.exit_code == 0 and "referenced in 1 earlier save" in r.stdout
    # verify checks the referenced object too: damage it and both steps fail (control: clean first)
    code, doc = _json(["verify", str(root), "--all", "--json"])
    assert code == 0 and [s["bytes"] for s in doc["steps"]] == [m1.nbytes, m2.nbytes]
    obj = root / m2.tensors["base"].object_key(0)
    b = bytearray(obj.read_bytes())
    b[m2.tensors["base"].shard_start(0)] ^= 1
    obj.write_bytes(bytes(b))
    code, doc = _json(["verify", str(root), "--all", "--json"])
    assert code == 1 and [s["error"] for s in doc["steps"]] == ["ChecksumMismatchError"] * 2


def test_delete_newest_without_force_is_a_usage_refusal_not_step_not_found(tmp_path):
    """Issue 47: ``ckptfmt delete URL NEWEST`` without --force reported StepNotFoundError ("no
    committed step") for a step that exists. Now exit 2 (usage) saying the step is the newest and
    to pass --force, as text and as --json; nothing deleted. Broken controls: a step that does not
    exist is still StepNotFoundError (exit 1), an older step deletes, and --force deletes the newest."""
    url = str(tmp_path / "repo")
    for step in (1, 2, 3):
        ckptfmt.save(url, step, [LocalShard("w", (4,), "float32", Box.full((4,)), np.full(4, step, np.float32))])
    r = runner.invoke(app, ["delete", url, "3"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.stderr.split())
    assert "step 3 is the newest committed step" in text and "--force" in text and "StepNotFound" not in text
    code, doc = _json(["delete", url, "3", "--json"])
    assert code == 2 and doc["ok"] is False and doc["error"] == "usage" and doc["step"] == 3 and doc["newest"] is True
    assert "newest" in doc["message"] and "--force" in doc["message"]
    assert ckptfmt.Repository(url).steps() == [1, 2, 3]
    code, doc = _json(["delete", url, "9", "--json"])
    assert code == 1 and doc["error"] == "StepNotFoundError"
    assert _json(["delete", url, "2", "--json"])[0] == 0
    assert _json(["delete", url, "3", "--force", "--json"])[0] == 0
    assert ckptfmt.Repository(url).steps() == [1]


def test_delete_one_step_and_version(tmp_path):
    """Issue 30: ``ckptfmt delete URL STEP`` removes one committed step through Repository.delete
    (the step's objects go, the others' stay and still verify); the newest step needs --force; a
    step that is not committed and a path that is no repository are typed errors, nothing deleted.
    ``--version`` prints the version and the format revision."""
    import json as _json

    import numpy as np

    import ckptfmt
    from ckptfmt import LocalShard
    from ckptfmt_tools.cli import app as cli

    url = str(tmp_path / "repo")
    for step in (1, 2, 3):
        ckptfmt.save(url, step, [LocalShard("w", (4,), "float32", ckptfmt.Box.full((4,)),
                                            np.full(4, step, np.float32))])
    r = CliRunner().invoke(cli, ["delete", url, "3", "--json"])  # newest: refused (test below)
    assert r.exit_code == 2 and _json.loads(r.stdout)["error"] == "usage", r.output
    r = CliRunner().invoke(cli, ["delete", url, "7", "--json"])
    assert r.exit_code == 1 and _json.loads(r.stdout)["error"] == "StepNotFoundError", r.output
    r = CliRunner().invoke(cli, ["delete", str(tmp_path / "nothing"), "1", "--json"])
    assert r.exit_code == 1 and _json.loads(r.stdout)["error"] == "NotARepositoryError", r.output
    assert ckptfmt.Repository(url).steps() == [1, 2, 3]
    r = CliRunner().invoke(cli, ["delete", url, "2", "--json"])
    assert r.exit_code == 0 and _json.loads(r.stdout)["steps"] == [1, 3], r.output
    repo = ckptfmt.Repository(url)
    assert repo.steps() == [1, 3] and repo.verify(1) > 0 and repo.verify(3) > 0
    assert np.array_equal(repo.open(1).read("w"), np.full(4, 1, np.float32))
    r = CliRunner().invoke(cli, ["delete", url, "3", "--force", "--json"])
    assert r.exit_code == 0 and ckptfmt.Repository(url).steps() == [1], r.output
    r = CliRunner().invoke(cli, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith(f"ckptfmt {ckptfmt.__version__} (format version 1"), r.output
