"""Every Python block of README.md runs (issue 52 item 2).

Each block runs in a fresh process (JAX fixes its device count at import) from a scratch folder.
The quickstarts run exactly as printed. The three longer examples leave some names to the reader
("your NNX model", "your step", "on every rank"); what each assumes is defined in ASSUMES below,
in plain sight, and run before the block; the block's literal paths ("/tmp/llama", "/tmp/run",
"/ckpt/run") are replaced by folders of the test's (PATHS). A block that is not in ASSUMES runs as
printed, and a block the table names that the README no longer has fails the test.
Control: the manager example without its assumptions fails on the name it leaves to the reader.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("jax", "flax", "optax", "torch", "transformers")),
                       reason="the README's examples need the [jax,torch,hf] extras"),
]

ROOT = Path(__file__).resolve().parent.parent

#: What the examples leave to the reader, by the name of the block's ``--8<--`` marker.
ASSUMES: dict[str, str] = {
    # "Llama is your Flax NNX model; notebook 05 has a 60-line one": the tests' copy of it.
    "jax-to-hf": "from tests.torchproc.jax_models import Llama\n",
    # "opt: an optax optimizer"; "your step; it counts state["step"] too". The step asks for a
    # preemption (SIGTERM to this process) at its third call, so the README's own preemption
    # branch saves and ends the loop instead of running 10,000 steps.
    "manager": """\
import os, signal
import jax, optax
opt = optax.adam(1e-2)
calls = 0
def train_step(state):
    global calls
    calls += 1
    loss, grads = jax.value_and_grad(lambda p: (p["w"] - 1.0).__pow__(2).mean())(state["params"])
    updates, opt_state = opt.update(grads, state["opt"], state["params"])
    if calls == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state,
            "step": state["step"] + 1}, float(loss)
""",
    # "on every rank": one gloo rank here (the example loads at any world size), a model, its
    # optimizer's state, a scheduler and a Stateful data loader, at step 7.
    "dcp": """\
import os
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["README_PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.Linear(8, 4)
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.ones(2, 8)).sum().backward(); optim.step()
model_sd, optim_sd = get_state_dict(model, optim)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=10)
class Loader:  # a Stateful: DCP saves and loads it through state_dict/load_state_dict
    def __init__(self): self.position = 41
    def state_dict(self): return {"position": self.position}
    def load_state_dict(self, d): self.position = d["position"]
loader = Loader()
step = 7
""",
}
PATHS = ("/tmp/llama", "/tmp/run", "/ckpt/run")


def readme_blocks() -> list[tuple[str, str]]:
    """(name, code) of every ```python block, named by the ``--8<-- [start:NAME]`` marker above it
    (``block-N`` for one without)."""
    text = (ROOT / "README.md").read_text()
    out = []
    for i, m in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
        marker = re.findall(r"<!-- --8<-- \[start:([\w-]+)\] -->\n$", text[:m.start()])
        out.append((marker[0] if marker else f"block-{i}", m.group(1)))
    return out


def _run(name: str, code: str, tmp_path: Path, *, assumed: bool = True) -> subprocess.CompletedProcess:
    for i, path in enumerate(PATHS):
        code = code.replace(f'"{path}"', repr(str(tmp_path / f"repo{i}")))
    script = tmp_path / f"{name}.py"
    script.write_text((ASSUMES.get(name, "") if assumed else "") + code)
    from ckptfmt.coord import free_port

    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", README_PORT=str(free_port()))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_every_assumption_names_a_block():
    names = [n for n, _ in readme_blocks()]
    assert set(ASSUMES) <= set(names) and len(names) == len(set(names)), names
    assert {"quickstart-jax", "quickstart-torch"} <= set(names) and not set(ASSUMES) & {"quickstart-jax", "quickstart-torch"}


@pytest.mark.parametrize("name", [n for n, _ in readme_blocks()])
def test_readme_block_runs(name, tmp_path):
    code = dict(readme_blocks())[name]
    p = _run(name, code, tmp_path)
    assert p.returncode == 0, (name, p.stdout[-2000:], p.stderr[-4000:])


def test_an_example_without_what_it_assumes_fails(tmp_path):
    p = _run("manager", dict(readme_blocks())["manager"], tmp_path, assumed=False)
    assert p.returncode != 0 and "NameError: name 'opt' is not defined" in p.stderr, p.stderr[-2000:]
