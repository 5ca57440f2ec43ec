# rdmatensor: `make demo` and `make test` set up everything they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-host test-rdma clean proto bench

setup:
	@bash scripts/setup.sh $(VENV)

# Two SoftRoCE hosts (VMs where this kernel has no rdma_rxe): a Session over
# verbs moves every dtype, 1 B to 64 MiB and a growing dynamic tensor from
# one to the other, checked byte for byte.
demo: setup
	$(PY) -m rdmatensor devices
	$(PY) -m rdmatensor softroce vm --hosts 2 -- $(PY) examples/two_ranks.py vm --provider verbs

test: setup
	$(PY) scripts/run_tests.py

test-host: setup
	$(PY) scripts/run_tests.py --only host

test-rdma: setup
	$(PY) scripts/run_tests.py --only rdma

clean:
	rm -rf $(VENV) test-results .pytest_cache

proto: setup
	PYTHON=$(PY) bash scripts/gen_proto.sh

bench: setup
	$(PY) -m bench.cli
