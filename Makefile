# Set-up and entry points. `make receipts` and `make test` run `setup` themselves when needed.
#
#   make receipts [PROFILE=standard|ci|full|gpu] [OUT=dir] [SECTIONS=hashes,streams] [PARAMS="gen_tokens=8 steps=[64,100]"]
#                 [ENGINE="reference transformers:/path/to/model llamacpp:/path/model.gguf openai:URL"] [DUMPS=dir]
#                 [PROMPTS="my.jsonl [other.txt short]"]   (prompt files and built-in names: these prompts instead)
#   make diff BASE=receipt-folder PR=receipt-folder [OUT=dir]   (what moved, as markdown; exit 1 when it did)
#   make comment BASE=receipt-folder PR=receipt-folder [OUT=file]   (the PR comment: PR's summary and what moved,
#                 under GitHub's 65,536-character limit; to stdout without OUT)
#   make test [PYTEST_ARGS="-n auto"]   the full suite (what CI runs); PYTEST_ARGS: further pytest arguments
#   make test-quick  the tests not marked slow (pytest -m "not slow": within 2 minutes on 2 cores), for editing: the
#                    modules of tests/conftest.py's QUICK_MODULES less their tests marked @pytest.mark.slow
#   make lab [LAB_ARGS="--port=8890"] | make clean
#
# torch is pinned (TORCH_VERSION). Where pip finds a local CPU wheel of that version (find-links), the pin resolves
# to it; where only PyPI is seen, PyPI's Linux torch is a multi-GB CUDA build, so ask for the build you want:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu          (CPU)
#   make setup TORCH_VERSION=2.11.0 TORCH_INDEX=https://download.pytorch.org/whl/cu130   (CUDA 13)
#
# With an existing Python instead of the venv (e.g. the GPU machine: torch there, no network):
#   make receipts PROFILE=gpu PY=python3 WHEELS=.whl            (likewise make test / make diff with PY=...)
# PY names that Python: no venv is made and nothing is installed into it. WHEELS names a folder of wheels of the
# packages it lacks (scripts/gpu_wheels.sh fills .whl/ for the GPU machine); `setup` installs them offline into
# .deps/ and registers the Jupyter kernel there (scripts/setup_python.sh). The commands then run with lib and .deps
# on PYTHONPATH and .deps/share/jupyter (the kernel, nbconvert's templates) on JUPYTER_PATH.

PYTHON        ?= python3
VENV          := .venv
PY            := $(VENV)/bin/python
STAMP         := $(VENV)/.setup-stamp
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=
KERNEL_NAME   := exactness
# llama-cpp-python's prebuilt wheels: a folder given as LLAMA_WHEELS=DIR (none: llama.cpp is not installed)
LLAMA_WHEELS  ?=
WHEELS        ?=
DEPS          := .deps
PROFILE       ?= standard
SECTIONS      ?=
OUT           ?=
PARAMS        ?=
ENGINE        ?=
DUMPS         ?=
PROMPTS       ?=
LAB_ARGS      ?=
# further pytest arguments for make test / test-quick, e.g. PYTEST_ARGS="-n auto" (pytest-xdist: tests in parallel)
PYTEST_ARGS   ?=
# One CPU thread by default: the tiny preset's kernels are too small to gain from threads, and a second OpenMP
# thread spin-waits badly on a busy 2-core machine. Receipts record the thread count (env.numerics.cpu_threads).
export OMP_NUM_THREADS ?= 1

.PHONY: setup receipts diff comment test test-quick lab clean

ifeq ($(PY),$(VENV)/bin/python)
setup: $(STAMP)
	@# llama.cpp (optional; its tests skip without it), also into a venv made before the wheels folder was there
	@if [ -n "$(LLAMA_WHEELS)" ] && ! $(PY) -c "import llama_cpp" 2>/dev/null \
	    && ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1; then \
	    $(PY) -m pip install --find-links $(LLAMA_WHEELS) "llama-cpp-python[server]==0.3.36"; fi
else
export PYTHONPATH   := $(abspath lib):$(abspath $(DEPS))$(if $(PYTHONPATH),:$(PYTHONPATH))
export JUPYTER_PATH := $(abspath $(DEPS))/share/jupyter$(if $(JUPYTER_PATH),:$(JUPYTER_PATH))
setup:
	scripts/setup_python.sh '$(PY)' '$(WHEELS)' $(DEPS) $(KERNEL_NAME)
endif

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL_NAME) --display-name "Python (exactness)"
	@# llama.cpp (optional; its tests skip without it): from a folder of prebuilt wheels (LLAMA_WHEELS=DIR), since
	@# building it from source takes 15-40 minutes; elsewhere `pip install llama-cpp-python`.
	@if [ -z "$(LLAMA_WHEELS)" ]; then echo "llama-cpp-python not installed (its tests skip); for the llamacpp" \
	    "engine: pip install 'llama-cpp-python[server]' into .venv"; fi
	touch $(STAMP)

comma := ,
empty :=
space := $(empty) $(empty)
# PROMPTS as the prompts parameter: files made absolute (the notebooks run in notebooks/), each quoted for YAML.
PROMPT_LIST = $(subst $(space),$(comma),$(foreach f,$(PROMPTS),"$(if $(filter short code docs,$(f)),$(f),$(abspath $(f)))"))

receipts: setup
	$(PY) -m exactness receipts --profile $(PROFILE) $(if $(OUT),--out $(OUT)) $(if $(SECTIONS),--sections $(SECTIONS)) $(foreach p,$(PARAMS),--param '$(p)') $(if $(ENGINE),--engine $(foreach e,$(ENGINE),'$(e)')) $(if $(DUMPS),--dumps '$(DUMPS)') $(if $(PROMPTS),--param 'prompts=[$(PROMPT_LIST)]')

diff: setup
	$(if $(and $(BASE),$(PR)),,$(error make diff needs BASE=<receipt folder or receipt.json> and PR=<the same>))
	$(PY) -m exactness diff '$(BASE)' '$(PR)' $(if $(OUT),--out '$(OUT)')

comment: setup
	$(if $(and $(BASE),$(PR)),,$(error make comment needs BASE=<receipt folder or receipt.json> and PR=<the same>))
	$(PY) -m exactness comment '$(BASE)' '$(PR)' $(if $(OUT),--out '$(OUT)')

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-quick: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# JupyterLab on notebooks/, URL with its token printed here, no browser; --allow-root only as root (scripts/lab.sh).
lab: setup
	scripts/lab.sh $(LAB_ARGS)

clean:
	rm -rf $(VENV) $(DEPS) build lib/*.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
