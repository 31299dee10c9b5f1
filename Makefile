# make demo : tiny BERT, 2 CPU ranks, to 0.720 masked-LM accuracy; checks the MLPerf log
# make pretrain-demo : a small BERT pretrained from scratch, both phases, on Python's docstrings (~3 min)
# make test : the whole CPU test suite
# make lint : shellcheck / hadolint where installed
SHELL := /bin/bash
PKG   := benchmarks/bert/implementations/pytorch
VENV  := .venv
PY    := $(CURDIR)/$(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo pretrain-demo test lint venv clean

venv: $(STAMP)

# The venv is built on first use and rebuilt when the pins or the package's needs change.
$(STAMP): $(PKG)/constraints.txt $(PKG)/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(PKG)/constraints.txt -e "$(PKG)[dev,prep,mpi,tools]"
	touch $@

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PKG)/demo.sh

pretrain-demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PKG)/pretrain_demo.sh

test: $(STAMP)
	cd $(PKG) && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q --durations=15

lint: $(STAMP)
	cd $(PKG) && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -k lint

clean:
	rm -rf results build
