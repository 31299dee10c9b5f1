# make demo : tiny BERT, 2 CPU ranks, to 0.720 masked-LM accuracy; checks the MLPerf log
# make pretrain-demo : a small BERT pretrained from scratch, both phases, on Python's docstrings, then
#   fine-tuned on a downstream task against a randomly initialised twin (~20 min)
# make test : the whole CPU test suite (tests/unit and tests/integration)
# make test-fast : the unit tier alone (tests/unit: in-process, no launcher, cluster or image)
# make lint : shellcheck / hadolint where installed
# make preflight : the GPU device run on the device's Python, torch and Triton, on this CPU (its own
#   environment in .preflight, ~5 GB; bench/preflight.sh): run before any device call
SHELL := /bin/bash
PKG   := benchmarks/bert/implementations/pytorch
VENV  := .venv
PY    := $(CURDIR)/$(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Google's bert-tensorflow (bert/create_pretraining_data.py, bert/tokenization.py): the oracle the
# tests compare `create` with (bench/google_bert.py loads it by file path). Kept off sys.path in a
# folder of its own: its top-level package is named `bert`, like ours, and would shadow it.
ORACLE := $(VENV)/oracle
# TensorFlow (tensorflow-cpu + tf-keras, pinned in constraints-tf.txt), the interpreter that runs
# Google's BERT model and training code as the oracle of tests/integration/test_tf_oracle.py: a venv
# of its own inside .venv (1.6 GB, ~1 min from pip's cache), never on the main venv's sys.path.
TF_VENV  := $(VENV)/tf
TF_STAMP := $(TF_VENV)/.installed-stamp

.PHONY: demo pretrain-demo test test-fast lint venv prereqs clean preflight

venv: $(STAMP) $(TF_STAMP)

# What the venv needs from the system, checked before it is built (Debian package names).
# A C++ compiler is optional: without one, torch.compile's CPU kernels (model.compile_layers,
# optim.impl=compiled with inductor) cannot build and their test skips; warned, not refused.
prereqs:
	@python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "make: need python3 >= 3.11 (found: $$(python3 --version 2>&1 || echo none));" \
	       "install python3 (Debian: apt-get install python3)" >&2; exit 1; }
	@python3 -c 'import venv, ensurepip' 2>/dev/null || { \
	  echo "make: python3 has no venv/ensurepip module; install it (Debian: apt-get install python3-venv)" >&2; exit 1; }
	@command -v git >/dev/null || { echo "make: git not found; install it (Debian: apt-get install git)" >&2; exit 1; }
	@echo 'int main() { return 0; }' | "$${CXX:-g++}" -x c++ - -o /dev/null 2>/dev/null || \
	  echo "make: warning: no working C++ compiler ($${CXX:-g++}, what torch's inductor calls):" \
	       "torch.compile's CPU kernels cannot build and their test skips; to have them: apt-get install g++" >&2

# The venv is built on first use and rebuilt when the pins or the package's needs change.
$(STAMP): $(PKG)/constraints.txt $(PKG)/pyproject.toml
	@$(MAKE) --no-print-directory prereqs
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(PKG)/constraints.txt -e "$(PKG)[dev,prep,mpi,tools,tensorboard]"
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(ORACLE) -c $(PKG)/constraints.txt bert-tensorflow
	touch $@

# tf-keras --no-deps: its `tensorflow` requirement is met by tensorflow-cpu (constraints-tf.txt says why).
$(TF_STAMP): $(PKG)/constraints-tf.txt
	@$(MAKE) --no-print-directory prereqs
	test -x $(TF_VENV)/bin/python || python3 -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet -c $(PKG)/constraints-tf.txt tensorflow-cpu
	$(TF_VENV)/bin/python -m pip install --quiet --no-deps -c $(PKG)/constraints-tf.txt tf-keras
	touch $@

demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PKG)/demo.sh

pretrain-demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PKG)/pretrain_demo.sh

# One pytest-xdist worker per core (at most 8), a test file at a time each (its module
# fixtures, such as a SLURM cluster, made once), in the order conftest.py sorts the files;
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
test: $(STAMP) $(TF_STAMP)
	cd $(PKG) && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q --durations=15 \
	  -n $(TEST_WORKERS) --maxprocesses=8 --dist loadfile --no-loadscope-reorder

# The unit tier: the loop to run while changing code (the whole suite before landing).
test-fast: $(STAMP)
	cd $(PKG) && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q --durations=5 tests/unit \
	  -n $(TEST_WORKERS) --maxprocesses=8 --dist loadfile

lint: $(STAMP)
	cd $(PKG) && PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -k lint

clean:
	rm -rf results build

# Before a device call: the device run on the device's versions, here (bench/preflight.sh).
preflight:
	$(PKG)/bench/h200.sh preflight
