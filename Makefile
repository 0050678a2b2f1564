# Two commands on a fresh machine: `make demo` (train the demo) and `make test` (the suite).
# Each creates .venv and installs what it needs. torch is pinned first so that no install step
# can pull a different (CUDA) build; the project's own range admits the pinned one.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint docs unit bench clean gpu gpu-wheels audit lock

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# requirements.lock (`make lock`) pins every other distribution, as constraints: what CI
	# installs is what was tested here, and a new release upstream cannot change it.
	$(PY) -m pip install -q -c requirements.lock -e ".[dev,serve,track,tune,onnx,observe,kserve-client,finetune,interop,security,privacy,audit]"
	# KServe's client; --no-deps because kserve pins pandas<3 (see the kserve-client extra).
	$(PY) -m pip install -q --no-deps "kserve==0.21.0"
	# hpcml's own bytecode, written once: the editable install leaves it to the first import,
	# which writes nothing where PYTHONDONTWRITEBYTECODE is set (this sandbox, CI): every
	# new interpreter compiled the 248 modules again (0.45-1.5 CPU s each).
	$(PY) -m compileall -q src
	touch $(STAMP)

install: $(STAMP)

# The demo: 2-process DDP training of SimpleCNN on scikit-learn's digits (>= 97% validation).
demo: $(STAMP)
	$(VENV)/bin/hpcml train examples/digits_cnn.yaml --nproc 2 --run-dir runs/demo --overwrite

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks docs/gen
	$(VENV)/bin/mypy src
	$(VENV)/bin/lint-imports

# The docs site (MkDocs Material) into build/site; --strict makes any warning (a broken link or
# anchor, a page missing from the nav) fail. No -q: it would hide the warnings --strict counts.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Three xdist workers on CI's two cores: the SLURM, kill -9 and watchdog tests spend most of their
# time waiting (a job's time limit, a requeue, a hang being detected); a third worker runs other
# tests meanwhile instead of a core idling (CONTRIBUTING.md gives the measured times). The docs
# site is built strictly inside the suite (tests/unit/test_docs_generated.py's
# test_strict_site_build runs what `make docs` runs), not a second time before it.
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder --durations=25 tests

# The inner loop while changing code: unit and fuzz tests only (CONTRIBUTING.md gives its time).
.PHONY: test-fast
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests/unit tests/fuzz

unit: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

# Every GPU claim in one prepared command (benchmarks/gpu_proof.py; results/gpu/). On a GPU
# machine that starts bare it uses the machine's own torch and the wheels of `make gpu-wheels`;
# without a GPU it is the dry rehearsal (tests/integration/test_gpu_proof.py runs it).
gpu:
	bash benchmarks/gpu_run.sh

gpu-wheels: $(STAMP)
	bash benchmarks/gpu_wheels.sh

# A CycloneDX SBOM of .venv and its known vulnerabilities (pip-audit) into build/; exit 1 on a
# vulnerability, 0 with a line saying so where the vulnerability service is unreachable.
audit: $(STAMP)
	$(PY) .ci/audit.py

# requirements.lock: the versions installed in .venv now (torch left out: TORCH pins it, and
# the project itself, installed editable).
lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | grep -v -i '^torch==' > requirements.lock

bench: $(STAMP)
	$(PY) benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
