# The two commands of the README. Both set up everything they need on a fresh machine.
#   make run    the demo: the real daemon on a simulated 8-GPU node with real hung ranks (no GPU needed)
#   make test   lint, type-check and run the tests
VENV ?= .venv
PYTHON ?= python3
BIN = $(VENV)/bin

.PHONY: run test bench docs clean

# The tests wait on real processes, servers and clocks far more than they compute: six workers share two cores,
# an idle one taking queued tests from the others (worksteal), so the minute-long tests do not all end the run.
TEST_WORKERS ?= 6

# `make test` installs the test extras (a real browser driver, gRPC tools, the Kubernetes schemas...);
# `make run` only what the demo needs (the package and torch for its CPU ranks).
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(BIN)/.demo-installed

$(BIN)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	touch $@

run: $(BIN)/.demo-installed
	$(BIN)/stall-watchdog demo $(DEMO_ARGS)

test: $(BIN)/.installed
	$(BIN)/ruff check watchdog tests bench deploy tools
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

# Regenerate what is made from a fact kept elsewhere: config.example.yaml, the README's configuration
# reference and metric list, and the Kubernetes files made from them (tools/docs.py says which).
docs: $(BIN)/.demo-installed
	$(BIN)/python tools/docs.py

bench: $(BIN)/.installed
	$(BIN)/python bench/replay_throughput.py
	$(BIN)/python bench/detector_tick.py
	$(BIN)/python bench/differential.py --against 54db7e4 --per-class 3
	$(BIN)/python bench/capture_stacks.py
	$(BIN)/python bench/daemon_cost.py
	$(BIN)/python bench/series_budget.py
	$(BIN)/python bench/live_verdict.py
	$(BIN)/python bench/accuracy.py
	$(BIN)/python bench/accuracy.py --spins --per-class 1  # every card x sampling 1-10 s x spin power
	$(BIN)/python bench/straggler.py --per-class 2
	$(BIN)/python bench/straggler_live.py  # real gloo ranks under torchrun, about 40 minutes
	$(BIN)/python bench/soak.py
	$(BIN)/python bench/pod_resources.py
	$(BIN)/python bench/hostile_costs.py
	$(BIN)/python bench/direct_path.py
	$(BIN)/python bench/act_restart.py
	$(BIN)/python bench/prometheus_fleet.py  # the real prometheus (Debian: apt-get install prometheus)
	# 12,500 nodes (100,000 GPUs) for 30 minutes on each engine (Debian: prometheus, victoria-metrics)
	$(BIN)/python bench/prometheus_fleet.py --nodes 12500 --interval-seconds 60 --minutes 30
	$(BIN)/python bench/prometheus_fleet.py --nodes 12500 --interval-seconds 60 --minutes 30 --engine vmalert
	$(BIN)/python bench/coordinator_scale.py
	$(BIN)/python bench/nvml_cost.py  # on a machine with a GPU; says so and stops without one

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
