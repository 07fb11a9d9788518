# Two commands for a newcomer: `make demo` (the main job: the short drifting-style experiment) and `make test` (the tests).
# Both install what they need into .venv on first use and are quick on a second run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
PYTEST_ARGS ?=

.PHONY: demo test venv clean-data

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	@rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(BIN)/online-sao simulate --scenario configs/drift-short.yaml

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-data:
	rm -rf data
