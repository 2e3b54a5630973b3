# The README's two commands. Both build .venv on first use and reuse it after:
# the stamp file is keyed on pyproject.toml, so a dependency change reinstalls.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# cpu (default) or gpu: which fbgemm build to install (see README).
EXTRA  ?= cpu
STAMP  := $(VENV)/.installed-$(EXTRA)-$(shell sha256sum pyproject.toml | cut -c1-16)

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "recship needs Python 3.11, found " + sys.version'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[$(EXTRA),dev]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/recship demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
