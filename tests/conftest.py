import os
import sys
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(params=["file", "memory"])
def repo_url(request, tmp_path):
    """The same conformance checks run on the file and memory kvstores."""
    if request.param == "file":
        return str(tmp_path / "repo")
    return f"memory://{uuid.uuid4().hex}"
