# rdmatensor: `make demo` and `make test` set up everything they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-two-hosts test test-host test-rdma test-rails test-four-hosts clean proto bench bench-models bench-models-paired bench-hierarchical bench-ring bench-step-model bench-step-model-fit soak \
	horovod-reference horovodrun-two-hosts horovod-diff

setup:
	@bash scripts/setup.sh $(VENV)

# Data-parallel training (ring all-reduce, 2 workers, 8 images each). On the
# host, a real model (MobileNetV2, 32x32) over rdmatensor's shm and tcp beside
# its gRPC baseline, TensorFlow's own MultiWorkerMirroredStrategy and the
# no-communication floor; then, on real SoftRoCE in a VM, verbs beside tcp and
# the gRPC baseline (mlp: every instruction is emulated there).
demo: setup
	$(PY) -m rdmatensor devices
	$(PY) -m tf_plugin.training.cli --model mobilenetv2 --workers 2 --batch 16 --steps 20 \
	    --provider none,shm,tcp,grpc,tf-grpc
	$(PY) -m tf_plugin.training.cli --mode allreduce --workers 2 --model mlp --steps 30 --threads \
	    --provider verbs,tcp,grpc --softroce-vm
	@echo "In the VM, verbs is SoftRoCE: software RDMA in a kernel emulated instruction by instruction (qemu TCG)," \
	    "so it cannot beat the kernel's loopback TCP there; on an RDMA NIC the writes leave the CPU."

# Real models on the host, 2 workers with 8 images each at 32x32, one table per
# model, each from one run (BENCH_ROUNDS=N: N interleaved rounds, medians and
# ranges): the no-communication floor, the sync floor (one meeting per step), rdmatensor over shm and
# tcp, its gRPC baseline, TensorFlow's own strategy and real Horovod (gloo,
# built by horovod-reference); JSON in docs/models/.
BENCH_MODELS ?= resnet50 vgg16 densenet121 mobilenetv2 lm
BENCH_STEPS ?= 30
BENCH_PROVIDERS ?= none,sync,shm,tcp,grpc,tf-grpc,horovod
BENCH_ROUNDS ?= 1
BENCH_DIR ?= docs/models
bench-models: setup horovod-reference
	mkdir -p $(BENCH_DIR)
	for m in $(BENCH_MODELS); do \
	    $(PY) -m tf_plugin.training.cli --model $$m --workers 2 --batch 16 --steps $(BENCH_STEPS) \
	        --provider $(BENCH_PROVIDERS) --rounds $(BENCH_ROUNDS) --json $(BENCH_DIR)/$$m.json || exit 1; \
	done
	$(PY) -m bench.models_table $(addprefix $(BENCH_DIR)/,$(addsuffix .json,$(BENCH_MODELS)))

# The same models over shm with both floors timed in turn inside each job
# (--paired: immune to the host's cores drifting between jobs), 60 cycles of
# three steps; JSON in docs/models/paired/, table by
# `python -m bench.models_table --paired docs/models/paired/*.json`.
BENCH_PAIRED_STEPS ?= 181
bench-models-paired: setup
	mkdir -p docs/models/paired
	for m in $(BENCH_MODELS); do \
	    $(PY) -m tf_plugin.training.cli --model $$m --workers 2 --batch 16 --steps $(BENCH_PAIRED_STEPS) \
	        --provider shm --paired --json docs/models/paired/$$m.json || exit 1; \
	done
	$(PY) -m bench.models_table --paired $(addprefix docs/models/paired/,$(addsuffix .json,$(BENCH_MODELS)))

# The same models on rdmatensor's Horovod API (rdmatensor-train --provider hvd):
# the native ops and the Python path (RDMATENSOR_TF_OPS=python) timed in turn
# with both floors inside each job, 30 cycles of four steps, BENCH_ROUNDS jobs
# per model (default 3); JSON in docs/models/native/, table by
# `python -m bench.models_table --paired docs/models/native/*.json` (about 15 minutes).
BENCH_NATIVE_STEPS ?= 121
BENCH_NATIVE_ROUNDS ?= 3
.PHONY: bench-models-native
bench-models-native: setup
	mkdir -p docs/models/native
	for m in $(BENCH_MODELS); do \
	    TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m tf_plugin.training.cli --model $$m --workers 2 --batch 16 \
	        --steps $(BENCH_NATIVE_STEPS) --provider hvd --paired --rounds $(BENCH_NATIVE_ROUNDS) \
	        --json docs/models/native/$$m.json || exit 1; \
	done
	$(PY) -m bench.models_table --paired $(addprefix docs/models/native/,$(addsuffix .json,$(BENCH_MODELS)))

# The flat ring against the hierarchical all-reduce, side by side in one job
# of 4 ranks on 2 hosts (Horovod API): on this host with loopback addresses as
# hosts over shm, then tcp (uniform links: the steps alone); then on two
# SoftRoCE VMs over ssh, shm beside and verbs across (about 6 minutes).
bench-hierarchical: setup
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m bench.hierarchical local --provider shm
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m bench.hierarchical local --provider tcp
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m rdmatensor softroce vm --hosts 2 --ssh --timeout 1400 -- sh -c \
	    '$(PY) -m rdmatensor.runner.cli -np 4 -H 192.0.2.1:2,192.0.2.2:2 -x TF_CPP_MIN_LOG_LEVEL \
	         $(PY) -m bench.hierarchical job --sizes 1K,64K,1M,4M --rounds 5 --calls 5'

# The ring's CPU per all-reduce of real models' gradient sets (2 ranks, no model
# computing): streaming stores and gather writes (what training runs), gather
# writes alone, the copy-first ring, and the ring's memory traffic done locally
# (its floor), side by side in one job (2-4 minutes).
bench-ring: setup
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m bench.ring_cpu --models resnet50,vgg16,densenet121,mobilenetv2,lstm_lm \
	    --providers shm,tcp --json docs/ring-cpu.json

# The native all-reduce's toy step (docs/native-ops.md): 2 ranks on this host, a
# tf.function all-reducing N variables of 256 float32 (N = 10, 50, 200, 400)
# through tf_plugin.native's ops, its Python twin and today's hvd.allreduce, in
# interleaved rounds; medians, ranges and the fit fixed + per tensor (3-6 minutes).
.PHONY: bench-native
bench-native: setup
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m bench.native_step --rounds 5

# The shm executor alone (no TensorFlow): C, C with scalar loops, the Python twin, paired rounds
.PHONY: bench-shm-executor
bench-shm-executor: setup
	$(PY) -m bench.shm_executor --ways c,c-scalar,c-always-yield,twin --rounds 9 --calls 1000
	$(PY) -m bench.shm_executor --ways c,c-always-yield,twin --busy 2 --rounds 7 --calls 400

# The tape step against real Horovod (built by horovod-reference), in turn:
# rdmatensor's plain, sync-floor, Python-path and native steps, then Horovod's
# plain, sync-floor and DistributedGradientTape steps at its default cycle
# time and at 0, NATIVE_PAIRS times (about 4 minutes each); JSON in
# docs/native-step/ (docs/native-ops.md reads it).
NATIVE_PAIRS ?= 2
NATIVE_DIR ?= docs/native-step
.PHONY: bench-native-vs-horovod
bench-native-vs-horovod: setup horovod-reference
	mkdir -p $(NATIVE_DIR)
	for i in $$(seq $(NATIVE_PAIRS)); do \
	    $(PY) -m bench.native_step --paths tape-none,tape-sync,tape,tape-native \
	        --json $(NATIVE_DIR)/rdmatensor-$$i.json || exit 1; \
	    $(PY) -m bench.horovod_step --json $(NATIVE_DIR)/horovod-$$i.json || exit 1; \
	    $(PY) -m bench.horovod_step --cycle-time 0 --json $(NATIVE_DIR)/horovod-cycle0-$$i.json || exit 1; \
	done

# The step-time model (docs/step-model.md): its predictions for cases the fit
# never saw against paired measurements on this host, 2 ranks, shm and tcp
# (about 3 minutes); bench-step-model-fit refits its constants first (about 3).
bench-step-model: setup
	$(PY) -m bench.cli validate --json docs/step-model/validation.json

bench-step-model-fit: setup
	$(PY) -m bench.cli fit --rounds 5 --json docs/step-model/constants-host.json
	$(PY) -m bench.cli validate --predict-only --json docs/step-model/predictions.json

# Long runs without leaks: a two-worker training job (Horovod API, a small
# model) for SOAK_STEPS steps per provider, every rank sampling its RSS,
# descriptors, threads and shared memory every SOAK_EVERY steps; fails unless
# they stay flat after the warm-up. The figures go to docs/soak.json.
SOAK_STEPS ?= 100000
SOAK_EVERY ?= 5000
SOAK_PROVIDERS ?= shm,tcp
soak: setup
	$(PY) -m bench.soak --providers $(SOAK_PROVIDERS) --steps $(SOAK_STEPS) --every $(SOAK_EVERY) \
	    --json docs/soak.json

# Two hosts for real: two SoftRoCE VMs, sshd in each (keys made for this boot).
# From the first, rdmatensor-run starts one rank per host over ssh: Horovod's
# tape example trains over verbs between the hosts and says whether the ranks
# end bit-identical; then a Session checks every dtype, 1 B to 64 MiB; then
# Open MPI's mpirun starts 2 ranks per host (rank 0's rendezvous, no fixed
# ports), each using shm with the rank beside it and verbs across.
TWO_HOSTS := -np 2 -H 192.0.2.1:1,192.0.2.2:1 --provider verbs -x TF_CPP_MIN_LOG_LEVEL
demo-two-hosts: setup
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m rdmatensor softroce vm --hosts 2 --ssh --timeout 1800 -- sh -c \
	    '$(PY) -m rdmatensor.runner.cli $(TWO_HOSTS) $(PY) examples/horovod_tape.py --model mlp --steps 30 && \
	     $(PY) -m rdmatensor.runner.cli $(TWO_HOSTS) $(PY) examples/two_ranks.py job && \
	     RDMATENSOR_TOKEN=$$(openssl rand -hex 16) mpirun --allow-run-as-root -np 4 -H 192.0.2.1:2,192.0.2.2:2 \
	         --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0 -x RDMATENSOR_TOKEN \
	         -x MASTER_ADDR=192.0.2.1 -x MASTER_PORT=29500 $(abspath $(PY)) examples/all_pairs.py'

# Real Horovod 0.28.1 (TensorFlow ops, gloo, CPU) built into .venv-horovod
# against the project's TensorFlow, to measure beside (about 3-8 minutes, once),
# then horovodrun starting an rdmatensor job.
horovod-reference: setup
	bash scripts/horovod_reference.sh .venv-horovod

# Real Horovod against tf_plugin, call by call (tests/differential): seeded random
# sequences of eager collectives (every kind, op and dtype Horovod's CPU build
# takes; mismatches injected on one rank) under horovodrun --gloo and
# rdmatensor-run, every outcome compared, both against a numpy model of
# Horovod's semantics: 20 seeds of DIFF_CALLS calls on 2 ranks and DIFF_CALLS3 on
# 3, over shm and tcp (about 35 minutes); the 2-rank seeds again over shm with
# half of the calls each in a tf.function of its own (the native all-reduce
# there; about 30 minutes); then verbs in the SoftRoCE VM, replayed against
# Horovod's recordings. Counts in docs/differential/.
DIFF_CALLS ?= 500
DIFF_CALLS3 ?= 250
DIFF_DIR ?= test-results/differential
horovod-diff: setup horovod-reference
	mkdir -p docs/differential $(DIFF_DIR)
	$(PY) -m tests.differential.compare --ranks 2 --providers shm,tcp --seeds 1-20 --calls $(DIFF_CALLS) \
	    --out $(DIFF_DIR)/2 --json docs/differential/ranks2.json
	$(PY) -m tests.differential.compare --ranks 3 --providers shm,tcp --seeds 1-20 --calls $(DIFF_CALLS3) \
	    --out $(DIFF_DIR)/3 --json docs/differential/ranks3.json
	$(PY) -m tests.differential.compare --ranks 2 --providers shm --seeds 1-20 --calls $(DIFF_CALLS) --graph 0.5 \
	    --out $(DIFF_DIR)/graph2 --json docs/differential/graph2.json
	$(PY) -m tests.differential.compare --ranks 2 --providers "" --seeds 1-2 --calls 200 --out $(DIFF_DIR)/verbs-horovod
	$(PY) -m rdmatensor softroce vm --timeout 1500 --share $(DIFF_DIR) --share docs/differential -- \
	    env RDMATENSOR_TIMEOUT=60 $(PY) -m tests.differential.compare --ranks 2 --providers verbs --seeds 1-2 \
	    --calls 200 --out $(DIFF_DIR)/verbs --recorded $(DIFF_DIR)/verbs-horovod --json docs/differential/verbs.json

# Real horovodrun (built by horovod-reference) starting an rdmatensor job over
# ssh on two SoftRoCE VMs, 2 ranks each: rank 0 publishes its rendezvous in
# horovodrun's store; Horovod's tape example trains over shm+verbs (hierarchical
# all-reduce) and says whether the ranks end bit-identical (about 7 minutes).
horovodrun-two-hosts: setup horovod-reference
	TF_CPP_MIN_LOG_LEVEL=2 $(PY) -m rdmatensor softroce vm --hosts 2 --ssh --timeout 1100 -- sh -c \
	    'export RDMATENSOR_TOKEN=$$(openssl rand -hex 16) TF_CPP_MIN_LOG_LEVEL=2; \
	     .venv-horovod/bin/horovodrun -np 4 -H 192.0.2.1:2,192.0.2.2:2 --gloo --network-interface eth0 \
	         --start-timeout 300 $(abspath $(PY)) examples/horovod_tape.py --model mlp --steps 10'

test: setup
	$(PY) scripts/run_tests.py

# Two rails between two SoftRoCE VMs, each with two NICs and an rxe device on
# each (RDMATENSOR_IB_RAILS=2): every tensor intact, and a training job
# bit-identical to one rail with bytes on both NICs of both hosts. It proves
# bytes and bits, not speed (1 vCPU per VM); not part of `make test`.
test-rails: setup
	$(PY) -m pytest -v -s -p no:cacheprovider tests/vm/rails_check.py

# Four SoftRoCE VMs (1 vCPU each) on one shared segment, 2 ranks per host:
# every pair over verbs or shm, started by rdmatensor-run and by mpirun; an
# MLP trained with the hierarchical all-reduce off and on; each host's payload
# across hosts equal to the algorithms' counts. Bytes and bits, not speed;
# not part of `make test` (10-20 minutes on 2 cores).
test-four-hosts: setup
	$(PY) -m pytest -v -s -p no:cacheprovider tests/vm/four_hosts_check.py

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
