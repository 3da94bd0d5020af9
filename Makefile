# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test install lint bench chaos clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## run the container on the embedded broker with the sample listeners
## (Ctrl-C: the container stops cleanly and exits 0, but make dies of the same SIGINT
## and reports status 130; make gives a terminal's Ctrl-C no way around that)
run: $(STAMP)
	$(BIN)/mdb run -c settings.example.toml

## every test: unit, embedded transport, RabbitMQ and PostgreSQL (disruptive ones last, alone).
## Three workers on two cores: most tests wait on a process, a broker or a database, and two
## workers left the cores a third idle. The tests that build network namespaces or start
## RabbitMQ nodes share one xdist group (one worker, one at a time). The ten slowest tests
## are printed at the end.
test: $(STAMP)
	$(BIN)/ruff check mdbcontainer listeners tests benchmarks samples
	$(BIN)/mypy
	$(BIN)/pytest -m "not disruptive" -n 3 --dist loadgroup $(PYTEST_ARGS)
	$(BIN)/pytest -m disruptive -p no:randomly $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

lint: $(STAMP)
	$(BIN)/ruff check mdbcontainer listeners tests benchmarks samples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.run --full

clean:
	rm -rf .mdb .pytest_cache .mypy_cache .ruff_cache
