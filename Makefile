# The two commands: `make up` and `make test`. Both start with `make setup`.
.PHONY: setup up test lint unit vm-test vagrant-test

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

# The kernel tests on real guest kernels (Debian 12 and 13) under QEMU: see vagrant/run-tests.sh.
vm-test: setup
	bash vagrant/run-tests.sh

# The same guests through Vagrant and libvirt (qemu driver), in a network
# namespace of their own, from boxes built offline: see vagrant/vagrant-up-test.sh.
vagrant-test:
	bash vagrant/vagrant-up-test.sh
