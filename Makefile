# rdmatensor: `make demo` and `make test` set up everything they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-two-hosts test test-host test-rdma clean proto bench

setup:
	@bash scripts/setup.sh $(VENV)

# Data-parallel training (ring all-reduce, 2 workers, mlp) on real SoftRoCE:
# rdmatensor over verbs and tcp, rdmatensor's gRPC baseline, and TensorFlow's
# own MultiWorkerMirroredStrategy, one after the other, side by side.
demo: setup
	$(PY) -m rdmatensor devices
	$(PY) -m tf_plugin.launch --mode allreduce --workers 2 --model mlp --steps 30 --threads \
	    --provider verbs,tcp,grpc,tf-grpc --softroce-vm

# A Session over verbs between two SoftRoCE VMs: every dtype, 1 B to 64 MiB,
# a growing dynamic tensor, checked byte for byte.
demo-two-hosts: setup
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
