# Two commands on a fresh machine: `make run` and `make test`. Both install what they need.
# `make check` is the fast lane to run after each change: the unit and db lanes.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
PYTEST_ARGS ?=

.PHONY: install run check test mutations services down status lint types docs bench clean

install: $(VENV)/.installed

# Editable, from this checkout: the client (clients/python, which the server depends
# on) and the server, whose wheel is refused outside a dedicated environment
# (deploy/build_backend.py); an editable install puts none of its packages into site-packages.
$(VENV)/.installed: setup.cfg pyproject.toml clients/python/pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing poimen, its client and its dev dependencies into $(VENV) ..."
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ./clients/python -e '.[dev]'
	@touch $@

# Embedded Postgres/Redis/Kafka for whichever of DATABASE_URL, REDIS_URL,
# KAFKA_BOOTSTRAP_SERVERS is unset (state under .poimen/).
services: install
	$(BIN)/poimen-dev up

run: install
	$(BIN)/poimen-dev run

# The fast lane: the type check (`types`), then every test that starts no process
# (tests/process_guard.py keeps the `processes` mark complete): the unit lane, then the
# db lane in parallel (tests/lanes.py).
# Each lane prints its count and seconds; any non-zero pytest status fails it, 5 (no
# tests collected) included. The cross-feature model searches 15 examples per family here
# (make test 50, the mutation gate 150): at 50 it alone outlasts the lane's budget.
check: services types
	set -a; eval "$$($(BIN)/poimen-dev env)"; set +a; \
		POIMEN_MODEL_EXAMPLES=$${POIMEN_MODEL_EXAMPLES:-15} \
		$(BIN)/python -m tests.lanes unit db -- $(PYTEST_ARGS)

# Every lane (tests/lanes.py): unit, db in parallel, system in parallel by file and then
# its `alone` tests one at a time; each lane's count and time printed. The console's
# browser tests drive Debian's chromium, the partition tests iptables; without them they
# skip (and say so).
test: services types
	@{ command -v chromium && command -v chromedriver; } >/dev/null || [ "$$(id -u)" != 0 ] \
		|| apt-get install -y chromium chromium-driver \
		|| { apt-get update && apt-get install -y chromium chromium-driver; } \
		|| echo "make test: could not install chromium; tests/console will skip"
	@# The partition tests drop a path silently with iptables in a network namespace.
	@{ command -v iptables && command -v ip; } >/dev/null || [ "$$(id -u)" != 0 ] \
		|| apt-get install -y iptables iproute2 \
		|| { apt-get update && apt-get install -y iptables iproute2; } \
		|| echo "make test: could not install iptables; tests/chaos/test_partition.py will skip"
	set -a; eval "$$($(BIN)/poimen-dev env)"; set +a; $(BIN)/python -m tests.lanes -- $(PYTEST_ARGS)

# The mutation gate: every named mutant of a core rule must be killed by its tests.
mutations: services
	set -a; eval "$$($(BIN)/poimen-dev env)"; set +a; $(BIN)/python -m tests.mutations $(MUTATIONS_ARGS)

bench: services
	@command -v wrk >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y wrk \
		|| { apt-get update && apt-get install -y wrk; }
	set -a; eval "$$($(BIN)/poimen-dev env)"; set +a; \
	rec() { [ "$$1" = bench/execution.py ] && echo --record bench/RESULTS.md; true; }; \
	for b in bench/*.py; do $(BIN)/python $$b $$(rec $$b) || exit 1; done; \
	$(BIN)/python bench/execution.py --mode batch --repeat 3 --record bench/RESULTS.md || exit 1; \
	$(BIN)/python bench/e2e.py --mode batch --repeat 3 || exit 1; \
	$(BIN)/python bench/scaling.py --mode batch --workers 1 2 --inboxes 1

lint: install
	$(BIN)/ruff check .

# mypy --strict on the packages setup.cfg's [mypy] names (`files`); a type error fails
# `make check` and `make test` (CI) before any test runs.
types: install
	$(BIN)/mypy

# docs/operations/configuration.md, generated from settings_table.py (the one table of variables).
docs: install
	$(BIN)/python -m app.settings_reference

down:
	$(BIN)/poimen-dev down

status:
	$(BIN)/poimen-dev status

clean: down
	rm -rf .poimen $(VENV)
