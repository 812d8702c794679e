# The two set-up commands (see README): `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean bench drill faults docs

# torchtitan (tests/test_torchtitan.py) goes in without its requirements: its checkpointer and
# optimizer need only the pure-Python packages named; the rest (datasets, wandb, tensorboard) is
# heavy and would move fsspec back. `pip install ckptfmt[titan]` installs it whole.
$(STAMP): pyproject.toml constraints.txt
	@echo "Setting up $(VENV): ckptfmt with every extra (jax, torch, transformers, the test and docs tools) at"
	@echo "the versions in constraints.txt. About 2.3 GB; a few minutes the first time, skipped later."
	@echo "(To use ckptfmt in your own environment instead: pip install '.[jax]', see README.md.)"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[jax,torch,cli,dev,docs]"
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps torchtitan torch_checkpointing spmd_types \
		tyro docstring_parser typeguard einops torchdata
	@touch $(STAMP)
	@echo "$(VENV) is ready."

venv: $(STAMP)

# The end-to-end demo: a JAX job saves on 8 devices and resumes exactly on 4 (continuation
# receipt), then the recovery drill kills a 2-process training job mid-run and restores it on a
# new topology, printing the phase table and the guide's table. drill-out/ is the drill's own
# scratch output (ignored by git): each run replaces the previous one's, since the drill refuses
# a storage URL that already holds steps.
demo: $(STAMP)
	@echo; echo "== 1/2: a JAX job saves on 8 devices; a new job on 4 devices restores it and takes the next step"
	$(BIN)/python -m ckptfmt demo
	@rm -rf drill-out
	@echo; echo "== 2/2: the recovery drill: kill one process of a 2-process training job, restore on a new shape"
	$(BIN)/python -m ckptfmt drill --out drill-out

drill: $(STAMP)
	rm -rf drill-out
	$(BIN)/python -m ckptfmt drill --out drill-out

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 tests

bench: $(STAMP)
	$(BIN)/python -m ckptfmt bench

faults: $(STAMP)
	$(BIN)/python -m ckptfmt faults --peers

# The documentation site (mkdocs.yml) into site/; --strict fails on a broken link or a missing reference.
# The notebooks are executed while it builds (a minute or two; CKPTFMT_DOCS_EXECUTE=false skips that).
# `$(BIN)/mkdocs serve` serves it at http://127.0.0.1:8000 and rebuilds on every edit.
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
