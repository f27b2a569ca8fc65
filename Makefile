# The two commands a new user runs (README): `make fork` and `make test`.
PYTHON ?= python3
VENV := build/tools-venv
FORK := $(VENV)/bin/python -m tools.fork

.PHONY: fork test image check lint status clean

# Get and verify the pinned base, apply patches/, build the fork's wheel, print a summary.
fork: $(VENV)/.stamp
	$(FORK) apply
	$(FORK) build
	$(FORK) status

# The newest final release, tested beside the pin (each with its own vLLM and environment).
FINAL_BASE ?= 0.23.0.post1

# Check the series on every base, then run the fork's tests and upstream's CPU suite on base and
# fork, for the pin and for the newest final release (the tooling's own tests once).
test: $(VENV)/.stamp
	$(FORK) check --all-bases
	$(FORK) test
	$(FORK) test --base $(FINAL_BASE) --no-tooling-tests

# Build docker/Dockerfile.deploy with podman on a stand-in of the pinned release's image; verify,
# revert and compare inside it (.ci/image.sh; installs podman and debootstrap when missing).
image: $(VENV)/.stamp
	PYTHON=$(VENV)/bin/python .ci/image.sh

check: $(VENV)/.stamp
	$(FORK) check

lint: $(VENV)/.stamp
	$(VENV)/bin/pre-commit run --all-files

status: $(VENV)/.stamp
	$(FORK) status

$(VENV)/.stamp: tools/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r tools/requirements.txt
	touch $@

clean:
	rm -rf build dist
