# Two set-up commands: `make demo` and `make test`. Everything installs into a local virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; an unpinned torch pulls a multi-GB CUDA build. tools/torch_wheel.py takes it from
# TORCH_INDEX when that index is reachable and from the package registry otherwise. GPU machines:
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu128   (or TORCH_INDEX=registry)
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed
# TorchRec, a test dependency (the conformance suite in tests/trainer/ runs against it), beside the CPU torch:
# the CPU fbgemm-gpu, then torchrec itself without its requirements (they would pull the 0.5 GB CUDA build).
TORCHREC_DEPS ?= "fbgemm-gpu-cpu==1.8.0" pyre-extensions tensordict
TORCHREC_PIN ?= "torchrec==1.8.0"

.PHONY: install test lint demo proto bench bench-peers bytecode clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) tools/torch_wheel.py --pin "$(TORCH_PIN)" --index "$(TORCH_INDEX)"
	$(PY) -m pip install -q -e ".[dev,train]" "$(TORCH_PIN)"
	$(PY) -m pip install -q $(TORCHREC_DEPS) "$(TORCH_PIN)"
	$(PY) -m pip install -q --no-deps $(TORCHREC_PIN)
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

# Our modules' bytecode, written even where PYTHONDONTWRITEBYTECODE is set: every daemon, trainer and CLI
# process a test starts would otherwise compile them again (about 0.2 s a process, ~10% of the suite).
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 ps trainer embeddings tools proto > /dev/null

# One pytest-xdist worker per core, each test file on one worker (module-scoped clusters start once), handed out
# in collection order: the heaviest files first (tests/suite_order.py). The suite keeps 2 cores about 90% busy.
test: lint bytecode
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=25

demo: $(STAMP) bytecode
	$(VENV)/bin/tigana demo

# Regenerate the committed gRPC/protobuf code (tests/proto/test_generated.py fails when it is stale).
proto: $(STAMP)
	$(PY) -m tigana.proto.generate

bench: $(STAMP)
	$(VENV)/bin/tigana bench table --quick
	$(VENV)/bin/tigana bench ps --quick
	$(VENV)/bin/tigana bench train --quick
	$(VENV)/bin/tigana bench allreduce --quick
	$(VENV)/bin/tigana bench ps --replicas 1 --quick
	$(VENV)/bin/tigana bench failover --quick
	$(VENV)/bin/tigana bench reshard --quick
	$(VENV)/bin/tigana bench serving-sync --quick
	$(VENV)/bin/tigana bench serving --quick
	$(VENV)/bin/tigana bench checkpoint --quick
	$(VENV)/bin/tigana bench nemesis --quick

# The benchmark peers (TorchRec, as above: `make install` has it too); re-run after a venv made another way.
bench-peers: $(STAMP)
	$(PY) -m pip install -q $(TORCHREC_DEPS) "$(TORCH_PIN)"
	$(PY) -m pip install -q --no-deps $(TORCHREC_PIN)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
