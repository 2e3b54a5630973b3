# The README's two commands. Both build .venv on first use and reuse it after:
# the stamp file is keyed on pyproject.toml, so a dependency change reinstalls.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# cpu (default) or gpu: which fbgemm build to install (see README).
EXTRA  ?= cpu
STAMP  := $(VENV)/.installed-$(EXTRA)-$(shell sha256sum pyproject.toml | cut -c1-16)

.PHONY: demo test test-fast test-sanitize install clean cpp-deps wheel

install: $(STAMP) cpp-deps

# gRPC C++ for the C++ serving front and load generator (recship serve --front cpp, bench/serve_bench.py):
# Debian's packages, installed when missing where apt-get can run; without them everything else still works.
CPP_DEPS := libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
cpp-deps:
	@command -v grpc_cpp_plugin >/dev/null && command -v protoc >/dev/null && exit 0; \
	if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing gRPC C++ (Debian: $(CPP_DEPS))"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CPP_DEPS) >/dev/null; } \
			|| echo "note: installing gRPC C++ failed: --front cpp and the C++ load generator are skipped"; \
	elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then \
		echo "installing gRPC C++ (Debian: $(CPP_DEPS))"; \
		{ sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(CPP_DEPS) >/dev/null; } \
			|| echo "note: installing gRPC C++ failed: --front cpp and the C++ load generator are skipped"; \
	else \
		echo "note: gRPC C++ not found and apt-get unavailable: --front cpp and the C++ load generator are skipped ($(CPP_DEPS))"; \
	fi

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "recship needs Python 3.11, found " + sys.version'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[$(EXTRA),dev]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP) cpp-deps
	$(VENV)/bin/recship demo

# -rs prints why each skipped test was skipped (no GPU; a compiler that cannot link the sanitizers: the C++
# tests' AddressSanitizer + UBSan run, tests/cpp_loader/test_cpp_sanitized.py, is part of the suite).
# pytest-xdist runs the tests on a worker per core (at most 4: each holds torch and the models of its tests), a
# module's tests on one worker (--dist loadscope: a module's fixtures are built once); TEST_WORKERS=0 runs them in
# this process. --durations=25 names where the time went.
TEST_WORKERS ?= auto --maxprocesses=4
PYTEST := $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadscope --durations=25
test: $(STAMP) cpp-deps
	$(PYTEST)

# the quick loop (about 2 minutes on 2 cores): every package, without the tests marked slow, cpp (the C++ build),
# distributed (several ranks) or gpu; tests/conftest.py assigns the markers, `make test` runs them all
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not cpp and not distributed and not gpu"

# only that sanitizer run (its build is cached in build/cpp_loader_sanitize, as the normal one in build/cpp_loader)
test-sanitize: $(STAMP) cpp-deps
	$(PY) -m pytest -q -rs tests/cpp_loader/test_cpp_sanitized.py

# dist/: the sdist and the manylinux wheel built from it, with the C++ parts (cpp_loader/make_wheel.py: python -m build,
# then auditwheel repair; about 2 minutes on 2 cores). RECSHIP_BUILD_CPP=front makes a missing recship_front an error.
wheel: $(STAMP) cpp-deps
	$(PY) cpp_loader/make_wheel.py --outdir dist

clean:
	rm -rf $(VENV) build dist *.egg-info
