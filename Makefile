# Set-up and entry points. `make receipts` and `make test` run `setup` themselves when needed.
#
#   make receipts [PROFILE=ci|full|gpu] [OUT=dir] [PARAMS="gen_tokens=8 steps=[64,100]"]
#   make test | make lab | make clean
#
# torch is pinned (TORCH_VERSION). On this project's machines the pin resolves to a CPU wheel on disk; where only
# PyPI is seen, PyPI's Linux torch is a multi-GB CUDA build, so ask for the build you want:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu          (CPU)
#   make setup TORCH_VERSION=2.11.0 TORCH_INDEX=https://download.pytorch.org/whl/cu130   (CUDA 13)

PYTHON        ?= python3
VENV          := .venv
PY            := $(VENV)/bin/python
STAMP         := $(VENV)/.setup-stamp
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=
KERNEL_NAME   := exactness
PROFILE       ?= full
OUT           ?=
PARAMS        ?=
# One CPU thread by default: the tiny preset's kernels are too small to gain from threads, and a second OpenMP
# thread spin-waits badly on a busy 2-core machine. Receipts record the thread count (env.numerics.cpu_threads).
export OMP_NUM_THREADS ?= 1

.PHONY: setup receipts test lab clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL_NAME) --display-name "Python (exactness)"
	touch $(STAMP)

receipts: setup
	$(PY) -m exactness receipts --profile $(PROFILE) $(if $(OUT),--out $(OUT)) $(foreach p,$(PARAMS),--param '$(p)')

test: setup
	$(PY) -m pytest -q

lab: setup
	$(VENV)/bin/jupyter lab

clean:
	rm -rf $(VENV) build lib/*.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
