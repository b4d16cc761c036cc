# The two commands of the README. Each installs what it needs (idempotently) first.
.PHONY: demo test install

install:
	@scripts/bootstrap

demo: install
	.venv/bin/kvoffload bench hotcache --json
	.venv/bin/kvoffload bench gather --json

test: install
	.venv/bin/python -m pytest
