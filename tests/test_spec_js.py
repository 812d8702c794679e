"""The guide's runnable specimen, extended to the golden repositories, runs under Node.js
(spec/examples/distributed-checkpointing.test.mjs): the format is readable outside Python."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SPECIMEN = Path(__file__).resolve().parent.parent / "spec" / "examples" / "distributed-checkpointing.test.mjs"


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js (node) is not installed on this machine")
def test_guide_specimen_passes_on_the_golden_manifests():
    out = subprocess.run(["node", "--test", str(SPECIMEN)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "PASS: incomplete checkpoints stay private" in out.stdout
    assert "# pass 3" in out.stdout and "# fail 0" in out.stdout, out.stdout[-2000:]


SCHEMA = Path(__file__).resolve().parent.parent / "spec" / "manifest.schema.json"
PROBES = ["", "id", "id\n", "id\n\n", "global", "global\n", "rank/1", "rank/1\n", "c", "c/0", "c/0\n", "a/", "a/\n",
          "saves/x/t/000001", "saves/x/t/\n", "a//b", "../x", "a:b", "ab\u0001", "\nid"]


def _patterns(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "pattern" and isinstance(v, str)] + \
            [p for k, v in node.items() if k != "pattern" for p in _patterns(v)]
    return [p for v in node for p in _patterns(v)] if isinstance(node, list) else []


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js (node) is not installed on this machine")
def test_schema_patterns_agree_between_python_jsonschema_and_ecma262():
    """Issue 47 item 14.5: every pattern of spec/manifest.schema.json accepts the same strings under
    Python's jsonschema (re.search, where "$" also matches before a final line feed) and under
    ECMA-262 (Node.js RegExp with the "u" flag, as JSON Schema specifies). Control: the bare "$"
    form of the save_id pattern is caught disagreeing."""
    import json

    import jsonschema
    patterns = sorted(set(_patterns(json.loads(SCHEMA.read_text()))))
    control = "^[0-9A-Za-z][0-9A-Za-z._-]{0,127}$"
    assert control not in patterns and len(patterns) >= 8

    def python(ps):
        return [[jsonschema.Draft202012Validator({"pattern": p}).is_valid(s) for s in PROBES] for p in ps]

    script = ("const [ps, ss] = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
              "console.log(JSON.stringify(ps.map(p => ss.map(s => new RegExp(p, 'u').test(s)))));")
    out = subprocess.run(["node", "-e", script], input=json.dumps([patterns + [control], PROBES]),
                         capture_output=True, text=True, timeout=60, check=True)
    js = json.loads(out.stdout)
    py = python(patterns + [control])
    assert js[-1] != py[-1]  # the control: "id\n" splits them
    assert {p: r for p, r in zip(patterns, py[:-1])} == {p: r for p, r in zip(patterns, js[:-1])}
