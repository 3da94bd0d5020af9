# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test install lint docs bench chaos record clean

# Quiet: pip's own warnings about a machine's missing extra indexes (a pip.conf naming folders
# that are not there) and setuptools' editable-install notice are dropped; errors still show,
# and a failed install still fails the target (pipefail).
QUIET_PIP = PYTHONWARNINGS=ignore bash -o pipefail -c '"$$0" -m pip install --quiet "$$@" 2>&1 \
	| { grep -v "is ignored: it is neither a file nor a directory" || true; }' $(BIN)/python

$(STAMP): pyproject.toml
	@echo "installing mdbcontainer and its test and docs extras into $(VENV)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(QUIET_PIP) --upgrade pip
	@$(QUIET_PIP) -e '.[test,docs]'
	@touch $(STAMP)

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
## are printed at the end. The short record is disruptive by its load, not by what it stops
## (its RabbitMQ cluster and PostgreSQL pair are its own): it runs beside the disruptive tests
## that restart the machine's RabbitMQ, one at a time, and its output follows theirs.
test: $(STAMP)
	$(BIN)/ruff check mdbcontainer listeners tests benchmarks samples
	$(BIN)/mypy
	$(BIN)/pytest -m "not disruptive" -n 3 --dist loadgroup $(PYTEST_ARGS)
	@log=$$(mktemp); \
	$(BIN)/pytest -m disruptive -k short_record -p no:cacheprovider $(PYTEST_ARGS) >$$log 2>&1 & record=$$!; \
	$(BIN)/pytest -m disruptive -k "not short_record" -p no:randomly $(PYTEST_ARGS); rc=$$?; \
	wait $$record; rrc=$$?; echo "--- the short record, beside them ---"; cat $$log; rm -f $$log; \
	{ [ $$rc -eq 0 ] || [ $$rc -eq 5 ]; } && { [ $$rrc -eq 0 ] || [ $$rrc -eq 5 ]; }

lint: $(STAMP)
	$(BIN)/ruff check mdbcontainer listeners tests benchmarks samples
	$(BIN)/mypy

## the documentation site (mkdocs.yml, docs/) into site/: strict (a broken link or a missing
## page fails), nothing fetched from outside; tests/docs/ checks its examples and its pages
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

chaos: $(STAMP)
	$(BIN)/python -m tests.chaos.run --full

## the record (tests/record/run.py): seeded faults against a fleet on its own RabbitMQ cluster and
## PostgreSQL pair, then lost/duplicated/unexpected/recovered per port. SEED empty: a random one.
SEED ?=
MINUTES ?= 10
REPLICATION ?= sync
MEAN_GAP ?= 30
record: $(STAMP)
	$(BIN)/python -m tests.record.run $(if $(SEED),--seed $(SEED)) --minutes $(MINUTES) \
		--replication $(REPLICATION) --mean-gap $(MEAN_GAP)

clean:
	rm -rf .mdb .pytest_cache .mypy_cache .ruff_cache site
