"""Every notebook executes top to bottom (nbclient), and is stored without outputs."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.fixture(scope="session")
def kernel_manager_factory():
    """A ``python3`` kernel that runs on this interpreter (the venv), whatever is on PATH.

    Installs the kernelspec into ``sys.prefix`` when it is missing (``ipykernel install
    --sys-prefix``), then checks that the command it launches is this interpreter.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import KernelManager

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
                       check=True, capture_output=True)

    def make() -> KernelManager:
        km = KernelManager(kernel_name="python3")
        cmd = km.format_kernel_cmd()
        assert Path(cmd[0]).resolve() == Path(sys.executable).resolve(), cmd
        return km

    return make


def test_every_notebook_is_listed():
    assert [p.name for p in PATHS] == ["01_format_tour.ipynb", "02_jax_to_pytorch.ipynb", "03_resharding.ipynb",
                                       "04_faults_and_recovery.ipynb", "05_llama_jax_to_hf.ipynb",
                                       "06_torch_first.ipynb"]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_executes(path, kernel_manager_factory, monkeypatch):
    monkeypatch.delenv("CKPTFMT_DRILL_RECEIPT", raising=False)  # notebook 04 runs its own drill
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", km=kernel_manager_factory(), timeout=240,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    print(f"{path.name}: {elapsed:.1f} s")
