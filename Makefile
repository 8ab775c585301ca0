# Everything a newcomer needs, from a fresh machine (Python 3.11 and Go on PATH).
#   make demo   set up, then run an annotated Job of torchrun on local real nodes (root)
#   make test   set up, then lint, type-check and run every test
#   make contract  torch's elastic-agent scenarios over our backend and c10d (tests/contract)
PYTHON ?= python3
UV_VERSION := 0.13.9
VENV := .venv
BIN := $(VENV)/bin
# uv keeps its inter-process locks in TMPDIR and never removes them (astral-sh/uv#10773):
# ours go to our cache, not to /tmp.
UV_LOCKS := $(or $(K8S_RDZV_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/k8s-rendezvous)/uv-locks
UV := TMPDIR=$(UV_LOCKS) $(PYTHON) -m uv

.PHONY: setup venv binaries test contract lint docs release-check demo cluster-up cluster-down

setup: venv binaries

venv: $(VENV)/.synced

# uv installs the locked environment (torch included, for the tests) in seconds once its
# cache is warm; the first time it downloads a few GB from PyPI.
$(VENV)/.synced: pyproject.toml uv.lock | $(UV_LOCKS)
	$(PYTHON) -m uv --version 2>/dev/null | grep -q "$(UV_VERSION)" || \
		$(PYTHON) -m pip install --quiet --disable-pip-version-check "uv==$(UV_VERSION)"
	$(UV) sync --frozen
	touch $@

$(UV_LOCKS):
	mkdir -p $@

# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, kwok and helm,
# then the real nodes' kubelet, containerd, runc and CNI plugins, built from the Go module
# proxy into ~/.cache/k8s-rendezvous (8 min on 2 cores with Go's module cache warm).
binaries:
	devkit/cluster/build.sh >/dev/null
	devkit/cluster/build.sh nodes >/dev/null

# Seconds, once actionlint is built (about 10 s, once, from the Go module proxy into
# ~/.cache/k8s-rendezvous): actionlint runs shellcheck on the workflows' scripts, and the
# docs site must build with --strict (no broken link between its pages).
lint: venv docs
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	"$$(hack/tools.sh actionlint)" -shellcheck $(BIN)/shellcheck -pyflakes= -no-color
	$(BIN)/python -m hack.check_links

# The docs site (mkdocs.yml) into site/.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# What a release publishes, built and checked but not published (hack/build_release.py,
# as .github/workflows/release.yml runs it): the sdist and wheel, the chart package.
release-check: setup | $(UV_LOCKS)
	$(BIN)/python -m hack.build_release --uv "env $(UV)"

# Every test but torch's own c10d backend as the control of the contract scenarios (it
# tests torch, and on two loaded cores some of its scenarios are timing-sensitive:
# tests/contract/README.md; `make contract` runs them), in two lanes side by side, each
# its own pytest session and control plane (hack/test_lanes.py). The tests' files go to
# one directory under /tmp, removed once every lane passed and kept for a look otherwise.
# At the end: each tier's wall time and the 25 slowest tests.
test: setup lint release-check
	$(BIN)/python -m hack.test_lanes

# Only torch's elastic-agent scenarios (also in `make test`: about 10 min of it).
contract: setup
	$(BIN)/pytest tests/contract --durations=0

demo: setup
	$(BIN)/python examples/demo.py

cluster-up: setup
	$(BIN)/python -m devkit.cluster up

cluster-down: venv
	$(BIN)/python -m devkit.cluster down
