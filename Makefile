# The front door, from a fresh clone:
#   make demo    install into .venv/, then train the 2-rank CPU demo (configs/demo_cpu.py)
#   make test    install into .venv/, then run the test suite (the command .ci/run runs)
# Both use a virtual environment: Debian's and Ubuntu's system pip refuse to install (PEP 668).
# Needs python3 >= 3.10 with venv (Debian: apt install python3-venv) and make.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch 2.13.0: without an NVIDIA driver, the CPU wheel from PyTorch's CPU index (no multi-GB CUDA libraries);
# with one (nvidia-smi on PATH), PyPI's default Linux wheel, which bundles its CUDA runtime.
# Override with e.g. make test TORCH_INDEX=https://download.pytorch.org/whl/cu128. An index that does not answer
# a 5 s probe is left out (said on the console), so a machine that reaches only a mirror does not wait on it.
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
ARGS  ?=
TESTS ?= tests

.PHONY: install demo test clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
# one 5 s probe of TORCH_INDEX (scripts/torch_index.py): out of reach, pip's own index is used at once
	$(PY) -m pip install torch==2.13.0 $$($(PYTHON) scripts/torch_index.py "$(TORCH_INDEX)")
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-build-isolation deepspeed  # its setup.py imports torch: build against ours
# transformers' Megatron GPT-2 converter, which a test runs on our Megatron export: only its source tree has it
	$(PY) -m pip download transformers==4.46.3 --no-binary :all: --no-deps -d $(VENV)/sdist
	tar xzf $(VENV)/sdist/transformers-4.46.3.tar.gz -C $(VENV) --strip-components=5 \
		transformers-4.46.3/src/transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py
# the CPU Adam ops, compiled into torch's extension cache now rather than in a run's first minute; a machine
# without a compiler is told so and goes on (runs fall back to torch's fused Adam); cached ops only load
	$(VENV)/bin/zerogpt build-ops
	touch $@

demo: install
	$(VENV)/bin/zerogpt run --nproc-per-node 2 train_gpt.py --config configs/demo_cpu.py $(ARGS)

test: install
	$(PY) -m pytest $(TESTS) -q

clean-venv:
	rm -rf $(VENV)
