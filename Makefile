# The two commands a new user runs (README): `make fork` and `make test`.
PYTHON ?= python3
VENV := build/tools-venv
FORK := $(VENV)/bin/python -m tools.fork

.PHONY: fork test image check lint status faults clean npu-report

# Get and verify the pinned base, apply patches/, build the fork's wheel, print a summary.
fork: $(VENV)/.stamp
	$(FORK) apply
	$(FORK) build
	$(FORK) status

# The newest final release, tested beside the pin (each with its own vLLM and environment).
FINAL_BASE ?= 0.23.0.post1

# Other releases whose test environments `make test` needs: the registry pre-release the tooling's
# rebase test moves the series onto (test_rebase_real.py).
PREFETCH_BASES ?= 0.24.0rc1

# The series' size against its budgets (tools/series_size.py); check the series on every base, then
# run the fork's tests and upstream's CPU suite on base and fork, for the pin and for the newest final
# release. The newest final release is tested side by side with the pin (each suite is one process: two
# cores do both), with the tooling's own tests (they do not depend on the base; its suite is the shorter),
# its output in build/test-$(FINAL_BASE).log, printed after the pin's; the other environments build in the
# background meanwhile (a no-op once cached; their logs: build/prefetch/; a failed prefetch is reported,
# and the step that needs one builds it).
test: $(VENV)/.stamp
	$(VENV)/bin/python tools/series_size.py
	$(FORK) check --all-bases
	@mkdir -p build/prefetch; \
	for v in $(PREFETCH_BASES); do \
		$(FORK) test --env-only --base $$v >build/prefetch/$$v.log 2>&1 || echo "prefetch of $$v's test environment failed: build/prefetch/$$v.log" & \
	done; \
	$(FORK) test --base $(FINAL_BASE) >build/test-$(FINAL_BASE).log 2>&1 & final=$$!; \
	$(FORK) test --no-tooling-tests; rc=$$?; \
	wait $$final || rc=1; echo; echo "== test --base $(FINAL_BASE) (build/test-$(FINAL_BASE).log)"; cat build/test-$(FINAL_BASE).log; \
	wait; exit $$rc

# Build docker/Dockerfile.deploy with podman on a stand-in of the pinned release's image; verify,
# revert and compare inside it (.ci/image.sh; installs podman and debootstrap when missing).
image: $(VENV)/.stamp
	PYTHON=$(VENV)/bin/python .ci/image.sh

check: $(VENV)/.stamp
	$(VENV)/bin/python tools/series_size.py
	$(FORK) check

lint: $(VENV)/.stamp
	$(VENV)/bin/pre-commit run --all-files

status: $(VENV)/.stamp
	$(FORK) status

# On an Ascend host with torch_npu, triton-ascend and the fork's vllm-ascend installed, PYTHON being
# the Python that serves: the trees, then the NPU evidence (op tests on fork and base, race stress with
# controls, the copy paths' speed) and the verdict on `memmove` in build/npu-report-npu/
# (docs/testing.md, "On an NPU"). More options: NPU_REPORT_ARGS="--budget 1800".
npu-report:
	$(PYTHON) -m tools.fork apply
	$(PYTHON) -m tools.fork apply --base-only
	$(PYTHON) -m tools.fork npu-report $(NPU_REPORT_ARGS)

# The crash tests at every kill point (`make test` runs a sample): deploy --to/--revert, apply and
# rebase SIGKILLed before each of their file steps, then recovered (docs/deploy.md, docs/rebase.md).
faults: $(VENV)/.stamp
	FORK_FAULTS=all $(VENV)/bin/python -m pytest tools/fork/tests/test_faults_deploy.py tools/fork/tests/test_faults_repo.py -q -s

# pip, not uv, makes this venv: uv is one of the packages it installs.
$(VENV)/.stamp: tools/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -r tools/requirements.txt
	touch $@

clean:
	rm -rf build dist
