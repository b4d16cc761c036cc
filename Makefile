# The two commands of the README. Each installs what it needs (idempotently) first.
.PHONY: demo test install

install:
	@scripts/bootstrap

demo: install
	@for b in hotcache gather prefill prefix decode; do .venv/bin/kvoffload bench $$b --json || exit 1; done

test: install
	.venv/bin/python -m pytest
