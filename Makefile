# The two commands: `make up` and `make test`. Both start with `make setup`.
.PHONY: setup up test lint unit

VENV := .venv/bin

setup:
	@bash deploy/host-setup.sh

up: setup
	$(VENV)/nodesampler up

lint: setup
	$(VENV)/ruff check .
	$(VENV)/mypy

test: lint
	$(VENV)/pytest -q
