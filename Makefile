# The two front-door commands: `make demo` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints.txt
STAMP  := $(VENV)/.installed
OUT    ?= runs/demo

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): setup.cfg constraints.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,megatron-lm]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 2 --master-port $${DYNMO_DEMO_PORT:-29541} \
	  -m dynmo_plugin.train --dynmo --dynmo-config configs/layer_freezing.yaml --output $(OUT)
	$(VENV)/bin/dynmo report $(OUT)

test: $(STAMP)
	$(VENV)/bin/ruff check dynmo_plugin tests scripts
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --durations=15

bench: $(STAMP)
	$(PY) scripts/bench_balancers.py

clean:
	rm -rf $(VENV) runs .pytest_cache
