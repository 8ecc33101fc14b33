# The two commands: `make up` and `make test`. Both start with `make setup`.
.PHONY: setup setup-test setup-bench up test test-stress lint unit vm-test vagrant-test image

VENV := .venv/bin

# What running needs; setup-test adds what only the tests need (browser, QEMU, Prometheus, podman).
setup:
	@bash deploy/host-setup.sh

setup-test:
	@bash deploy/host-setup.sh test

# What the scripts under bench/ need beyond the tests' (wrk).
setup-bench:
	@bash deploy/host-setup.sh bench

up: setup
	$(VENV)/nodesampler up

lint: setup-test
	$(VENV)/ruff check .
	$(VENV)/mypy

test: lint
	$(VENV)/pytest -q

# The suite with the last CPU kept busy and every `timing` test three times over (tests/stress.sh).
test-stress: lint
	bash tests/stress.sh

# The kernel tests on real guest kernels (Debian 11, 12, 13 and unstable; no headers) under QEMU: see vagrant/run-tests.sh.
vm-test: setup-test
	bash vagrant/run-tests.sh

# The same guests through Vagrant and libvirt (qemu driver), in a network
# namespace of their own, from boxes built offline: see vagrant/vagrant-up-test.sh.
vagrant-test:
	bash vagrant/vagrant-up-test.sh

# The agent and control plane image (podman; BUILDER=docker works too), from wheels built here.
image: setup
	bash deploy/build-image.sh
