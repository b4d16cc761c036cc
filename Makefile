# The two commands of the README. Each installs what it needs (idempotently) first.
.PHONY: demo up bench test install

install:
	@scripts/bootstrap

# the main job: metastore + prefill + decode + proxy on loopback (tiny model), one long request, a summary
demo: install
	.venv/bin/kvoffload demo

# the same stack, left running until Ctrl-C
up: install
	.venv/bin/kvoffload up

bench: install
	@for b in hotcache gather prefill prefix decode pd load faults vllm; do .venv/bin/kvoffload bench $$b --json || exit 1; done

test: install
	.venv/bin/python -m pytest
