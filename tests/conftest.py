import os
import sys
import uuid

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run of `make test` (CI included), so that a
# failure reproduces from the commit alone; `HYPOTHESIS_PROFILE=explore make test` draws fresh
# random examples each run, to look for new counterexamples.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(params=["file", "memory"])
def repo_url(request, tmp_path):
    """The same conformance checks run on the file and memory kvstores."""
    if request.param == "file":
        return str(tmp_path / "repo")
    return f"memory://{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def _wide_cli_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's tables render as on a 200-column terminal in every test, however the suite runs
    (a worker process of ``pytest -n`` has no terminal, and rich falls back to 80 columns there,
    where a long path in a title wraps). Tests of narrow output set COLUMNS themselves."""
    monkeypatch.setenv("COLUMNS", "200")
