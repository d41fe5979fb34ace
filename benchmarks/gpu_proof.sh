#!/usr/bin/env bash
# What the GPU, roofline and multi-GPU issues ask to prove, on a device machine, by stage:
#   bash benchmarks/gpu_proof.sh env tests timing calibrate fidelity solutions shipped baseline1 baseline2
#                                setup corpus compat ray sandbox attacks overhead parallel_solutions parallel_corpus
#                                paper_corpus (PAPER_WS: its world sizes, default "2 4"; PAPER_PROBLEMS: a selection)
#                                accuracy (ACCURACY_WS, default "2 4 8": the honest and wrong candidates of
#                                tests/candidates/accuracy, both verdicts, issue 47)
#                                compile_bound (COMPILE_COPIES variants of each own-extension CUDA solution, default 6;
#                                COMPILE_ARM both|side|alone; COMPILE_PART i/n: that part of the folder only)
#                                serve (SERVE_MODES, default "cpu shared-gpu": latency and throughput through pkb serve;
#                                SERVE_SOAK evaluations of the soak in cpu mode, default 1000; 0: none; SERVE_ROUNDS
#                                latency rounds, default 3; starlette and uvicorn installed from .whl/ where the node lacks them)
#                                accuracy_rule (benchmarks/accuracy_rule.py, RULE_EVALUATIONS a setting, default 100, in
#                                parts of 25 side by side, then merged: the rule's pass rates, issue 53)
#                                integrity (benchmarks/integrity_corpus.py, every row INTEGRITY_RUNS times, default 1,
#                                INTEGRITY_JOBS at once, default 4, cpu mode: issue 53's corpus)
#                                differential (DIFF_WS, default "2 4 8": one stage each; DIFF_ARMS, default all four; PARALLEL
#                                the side-by-side arms' --parallel, default the machine's most: honest candidates alone and
#                                side by side, sandbox full and off, must get the same verdict, issue 36)
# (TESTS_K selects tests with -k, CORPUS the upstream reference folder (default ../shared/upstream/reference),
#  CORPUS_MODE its mode (default cuda with 2 GPUs, else shared-gpu), TIMING_PARTS the parts of gpu_timing.py, BASELINE_PROBLEMS the problems,
#  BASELINE_TIMEOUT the seconds one baseline case may take, OVERHEAD_PROBLEMS/OVERHEAD_ROUNDS the overhead stage's evaluations
#  and OVERHEAD_BUILD its build flag (default --cuda-build; empty leaves the build timing out), PARALLEL the
#  side-by-side arm's --parallel in the parallel_* stages (default: the machine's); the ray stage installs Ray from .whl/ where the node lacks it)
# Each stage writes $OUT/<stage>.txt (OUT defaults to .); a stage cut by its time limit keeps what it printed.
# Multicast stays off: these variables are set for every process started here.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PKB_CACHE_DIR="${PKB_CACHE_DIR:-$PWD/.pkb-cache}"  # calibrations, kept between calls on a warm machine
OUT="${OUT:-.}"
LIMIT="${STAGE_LIMIT_S:-560}"
NUM_GPUS="$(python3 -c 'import torch; print(torch.cuda.device_count())')"

stage() {
  local name="$1"; shift
  echo "== $name: $* ($(date -u +%H:%M:%SZ))"
  local began=$SECONDS
  timeout -k 10 "$LIMIT" "$@" 2>&1 | tee -a "$OUT/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - began)) s" | tee -a "$OUT/$name.txt"
}

for name in "$@"; do
  case "$name" in
    paper_corpus) for w in ${PAPER_WS:-2 4}; do  # every upstream file, both verdicts, side by side (issue 28)
        stage paper_corpus_w$w python3 -m pkb.cli run --solutions "${CORPUS:-../shared/upstream/reference}" --mode shared-gpu \
          --world-size "$w" --db "$OUT/paper_w$w.sqlite" --quiet ${PARALLEL:+--parallel "$PARALLEL"} \
          ${PAPER_PROBLEMS:+--problems "$PAPER_PROBLEMS"}
        stage paper_corpus_w$w python3 benchmarks/paper_summary.py "$OUT/paper_w$w.sqlite" --json "$OUT/paper_w$w.json"
      done ;;
    accuracy) for w in ${ACCURACY_WS:-2 4 8}; do  # honest sums of other orders and precisions, and wrong ones
        stage accuracy_w$w python3 -m pkb.cli run --solutions tests/candidates/accuracy --mode shared-gpu \
          --world-size "$w" --db "$OUT/accuracy_w$w.sqlite" --quiet ${PARALLEL:+--parallel "$PARALLEL"}
        stage accuracy_w$w python3 benchmarks/paper_summary.py "$OUT/accuracy_w$w.sqlite" --all --json "$OUT/accuracy_w$w.json"
      done ;;
    accuracy_rule) parts="" i=0  # each world size and dtype in parts of 25 evaluations, one process each
        for w in 2 4 8; do for d in bf16 fp32; do for k in $(seq 1 $(( (${RULE_EVALUATIONS:-100} + 24) / 25 ))); do
          i=$((i + 1)); parts="$parts $OUT/rule_part$i.json"
          python3 benchmarks/accuracy_rule.py --scenarios allreduce --world-sizes $w --dtypes $d --evaluations 25 \
            --seed $((1000 * k)) --out "$OUT/rule_part$i.json" > "$OUT/rule_part$i.txt" 2>&1 &
        done; done; done
        python3 benchmarks/accuracy_rule.py --scenarios colsum,rmsnorm --evaluations "${RULE_EVALUATIONS:-100}" \
          --out "$OUT/rule_local.json" > "$OUT/rule_local.txt" 2>&1 &
        wait
        stage accuracy_rule python3 benchmarks/accuracy_rule.py --merge $parts "$OUT/rule_local.json" \
          --out "$OUT/accuracy_rule.json" ;;
    integrity) stage integrity python3 benchmarks/integrity_corpus.py --runs "${INTEGRITY_RUNS:-1}" \
        --jobs "${INTEGRITY_JOBS:-4}" --out "$OUT/integrity.json" ;;
    env) stage env bash -c 'date -u +%Y-%m-%dT%H:%MZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
           python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, \"nccl\", torch.cuda.nccl.version())"
           nvidia-smi topo -m; python3 -m pkb.cli hardware' ;;
    tests) stage tests python3 -m pytest -m gpu -v -s --tb=short -p no:cacheprovider tests ${TESTS_K:+-k "$TESTS_K"} ;;
    timing) stage timing python3 benchmarks/gpu_timing.py ${TIMING_PARTS:-} ;;
    calibrate) stage calibrate python3 -m pkb.cli calibrate --out "$OUT/calibrate.json" ;;
    fidelity) [ "$NUM_GPUS" -ge 2 ] && stage fidelity python3 benchmarks/nccl_fidelity.py --world-size "$NUM_GPUS" ;;
    shipped) [ "$NUM_GPUS" -ge 2 ] &&  # the shipped solutions alone (each result times the reference beside it)
        stage shipped python3 -m pkb.cli run --solutions pkb/solutions --problems collectives --mode cuda --world-size 2 --perf --trials 3 --db /tmp/pkb-shipped.sqlite ;;
    solutions) [ "$NUM_GPUS" -ge 2 ] && {
        stage solutions python3 -m pkb.cli run --problems collectives --mode cuda --world-size 2 --perf --trials 3 --db /tmp/pkb-cuda.sqlite
        stage solutions python3 -m pkb.cli run --problems collectives --mode shared-gpu --world-size 2 --trials 3 --db /tmp/pkb-shared.sqlite; } ;;
    baseline1) stage baseline1 python3 -m pkb.cli baseline --world-size 1 --mode cuda --out "$OUT/baseline1.json" ;;
    baseline2) [ "$NUM_GPUS" -ge 2 ] && stage baseline2 python3 -m pkb.cli baseline --world-size "$NUM_GPUS" --mode cuda \
        --timeout "${BASELINE_TIMEOUT:-120}" --out "$OUT/baseline2.json" ${BASELINE_PROBLEMS:+--problems "$BASELINE_PROBLEMS"} ;;
    setup) stage setup bash -c 'rm -rf .venv && bash scripts/setup.sh && .venv/bin/pkb eval 1 reference --world-size 2 \
        --trials 1 --json | head -c 400; echo' ;;  # the node is offline: setup must reuse the active env's torch
    corpus) mode="${CORPUS_MODE:-$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)}"
        stage corpus python3 benchmarks/upstream_corpus.py --mode "$mode" --world-size 2 --trials 2 \
          ${CORPUS:+--corpus "$CORPUS"} --out "$OUT/corpus_${mode}_w2.json" ;;
    compat) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"
        for name in p2p_batched p2p_isend_irecv p2p_group_ops; do
          stage compat python3 -m pkb.cli eval alltoall "tests/candidates/$name.py" --mode "$mode" --world-size 2 --trials 2
        done ;;
    ray) if ! python3 -c "import ray" 2>/dev/null && [ -d .whl ]; then  # an offline node: Ray carried as wheels
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
          export PYTHONPATH="/tmp/site:$PYTHONPATH"
        fi
        mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"
        stage ray python3 -m pytest -q -p no:cacheprovider tests/integration/test_ray.py
        stage ray python3 -m pkb.cli run --problems collectives --mode "$mode" --world-size 2 --trials 2 --db /tmp/pkb-local.sqlite
        stage ray python3 -m pkb.cli run --problems collectives --mode "$mode" --world-size 2 --trials 2 --db /tmp/pkb-ray.sqlite --executor ray
        stage ray python3 benchmarks/executor_overhead.py --mode "$mode" --problems 1-8 --rounds 4 --slots 1 --out "$OUT/ray_${mode}.json"
        stage ray python3 benchmarks/executor_overhead.py --mode cpu --problems 1-8 --rounds 4 --slots 1,auto --out "$OUT/ray_cpu.json" ;;
    sandbox) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"  # what the candidate sandbox enforces here
        stage sandbox bash -c 'uname -r; id -u; cat /sys/kernel/security/lsm 2>/dev/null; echo
           python3 -c "from pkb.runtime.sandbox import offered; print(offered(\"auto\").describe())"'
        for level in auto off; do
          stage sandbox python3 -m pkb.cli eval allreduce benchmarks/sandbox_probe.py --mode "$mode" --world-size 2 \
            --trials 1 --sandbox "$level"
        done ;;
    attacks) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"  # the CI attacks, in a GPU mode
        stage attacks env PKB_CONTAINMENT_MODE="$mode" python3 -m pytest -q -p no:cacheprovider tests/integration/test_containment.py \
          ${ATTACKS_K:+-k "$ATTACKS_K"} ;;
    parallel_solutions) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"  # compile-bound: 7 CUDA extensions
        stage parallel_solutions python3 benchmarks/parallel_run.py pkb/solutions --mode "$mode" --world-size 2 \
          ${PARALLEL:+--parallel "$PARALLEL"} --timeout-s 500 --out "$OUT/parallel_solutions_${mode}.json" ;;
    parallel_corpus) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"
        stage parallel_corpus python3 benchmarks/parallel_run.py "${CORPUS:-../shared/upstream/reference}" --mode "$mode" \
          --world-size 2 ${PARALLEL:+--parallel "$PARALLEL"} --timeout-s 280 --out "$OUT/parallel_corpus_${mode}.json" ;;
    compile_bound) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"  # one cold build per file (issue 29)
        part="${COMPILE_PART:-1/1}"; folder="/tmp/compile-bound-${part//\//-of-}"; rm -rf "$folder"
        python3 benchmarks/compile_bound_folder.py "$folder" --copies "${COMPILE_COPIES:-6}" --part "$part"
        stage compile_bound python3 benchmarks/parallel_run.py "$folder" --mode "$mode" --world-size 2 --arm "${COMPILE_ARM:-both}" \
          ${PARALLEL:+--parallel "$PARALLEL"} --timeout-s 580 --out "$OUT/compile_bound_${COMPILE_ARM:-both}_$(basename "$folder").json" ;;
    serve) if ! python3 -c "import starlette, uvicorn" 2>/dev/null && [ -d .whl ]; then  # an offline node: carried wheels
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-serve .whl/*.whl
          export PYTHONPATH="/tmp/site-serve:$PYTHONPATH"
        fi
        for mode in ${SERVE_MODES:-cpu shared-gpu}; do  # issue 27: one verdict's latency, throughput against 1-8 clients
          stage serve python3 benchmarks/serve_latency.py --mode "$mode" --rounds "${SERVE_ROUNDS:-3}" \
            --file "${CORPUS:-../shared/upstream/reference}/2_allgather.py" --out "$OUT/serve_$mode.json"
        done
        [ "${SERVE_SOAK:-1000}" -gt 0 ] && stage serve python3 benchmarks/serve_latency.py --mode cpu --skip-latency \
          --clients "" --soak "${SERVE_SOAK:-1000}" --soak-clients 8 --file "${CORPUS:-../shared/upstream/reference}/2_allgather.py" \
          --out "$OUT/serve_soak_cpu.json" ;;
    overhead) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"
        stage overhead python3 benchmarks/sandbox_overhead.py --mode "$mode" --world-size 2 --problems "${OVERHEAD_PROBLEMS:-1-8}" \
          --rounds "${OVERHEAD_ROUNDS:-3}" ${OVERHEAD_BUILD---cuda-build} --out "$OUT/overhead_${mode}.json" ;;
    differential) mode="$([ "$NUM_GPUS" -ge 2 ] && echo cuda || echo shared-gpu)"
        for w in ${DIFF_WS:-2 4 8}; do
          stage differential_w$w python3 benchmarks/differential.py --mode "$mode" --world-sizes "$w" \
            ${DIFF_ARMS:+--arms "$DIFF_ARMS"} ${PARALLEL:+--parallel "$PARALLEL"} --out "$OUT/differential_${mode}_w$w.json"
        done ;;
    *) echo "unknown stage $name" >&2; exit 2 ;;
  esac
done
