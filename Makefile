# Two commands on a fresh machine: `make demo` and `make test`.
# The .venv is keyed on a hash of requirements.txt: a change rebuilds it, a second run reuses
# it. A change to pyproject.toml only re-installs mmgrpo itself (editable).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell sha256sum requirements.txt | cut -c1-16)
STAMP := $(VENV)/.installed-$(REQ_HASH)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: venv demo test test-fast lint bench clean

venv: $(VENV)/.editable

$(STAMP):
	@echo "Creating $(VENV) from requirements.txt (about 2 minutes, once)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	@echo "Building DeepSpeed's CPU communication op once (about 100 s), cached in $(VENV)/torch_extensions"
	TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions $(VENV)/bin/python -c \
		"from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder; ShareMemCommBuilder().load()" >/dev/null
	touch $@

$(VENV)/.editable: $(STAMP) pyproject.toml
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: venv
	$(VENV)/bin/mmgrpo demo

test: venv
	$(PY) -m pytest -q -n 2 --dist loadgroup

test-fast: venv
	$(PY) -m pytest -q -n 2 -m "not slow and not distributed"

lint: venv
	$(VENV)/bin/ruff check mmgrpo tests benchmarks

bench: venv
	$(PY) benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) runs
