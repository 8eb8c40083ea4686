# The two set-up commands: `make run` and `make test` (each builds .venv first). `make run` installs
# what running needs; `make test` (and lint, bench) adds the test tools of the `dev` extra.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench demo clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(BIN)/.installed-dev: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

run: $(BIN)/.installed
	$(BIN)/ember serve

demo: $(BIN)/.installed
	$(BIN)/ember demo

# The web page's tests drive Debian's Chromium (never a downloaded browser).
CHROMIUM ?= /usr/bin/chromium

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

# The A2A tests drive an independent client too: @a2a-js/sdk from the npm registry, on Debian's Node.js.
NODE ?= /usr/bin/node

$(NODE):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm

# The Redis bus's tests run a throwaway Debian redis-server (tests/redisserver.py).
REDIS_SERVER ?= /usr/bin/redis-server

$(REDIS_SERVER):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server

# The shell tool's sandbox, and its tests (tests/test_sandbox.py). `make run` does without it: the shell
# tool then refuses, saying how to enable one.
BWRAP ?= /usr/bin/bwrap

$(BWRAP):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap

# The email channel's tests read mail from a throwaway Dovecot (tests/imapserver.py).
DOVECOT ?= /usr/sbin/dovecot

$(DOVECOT):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends dovecot-imapd

tests/a2a_js/node_modules: tests/a2a_js/package-lock.json | $(NODE)
	cd tests/a2a_js && npm ci --no-audit --no-fund --silent
	touch $@

test: $(BIN)/.installed-dev $(CHROMIUM) $(REDIS_SERVER) $(BWRAP) $(DOVECOT) tests/a2a_js/node_modules
	EMBER_TEST_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest -q --durations=25

lint: $(BIN)/.installed-dev
	$(BIN)/ruff check ember tests bench

# About 13 minutes on 2 cores: commit cost, 1,000 sessions, the gateway under load, kill -9, memory at 10k, and
# 1, 2, 4 workers on a throwaway PostgreSQL + Redis against SQLite (quick forms of the last four).
bench: $(BIN)/.installed-dev $(REDIS_SERVER)
	$(BIN)/python bench/commit_cost.py
	$(BIN)/python bench/sessions_load.py
	$(BIN)/python bench/gateway_load.py --quick
	$(BIN)/python bench/crash.py --quick
	$(BIN)/python bench/memory_scale.py --quick
	$(BIN)/python bench/scale_out.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
