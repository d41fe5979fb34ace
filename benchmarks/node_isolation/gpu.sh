#!/usr/bin/env bash
# Issue 48 on one GPU in shared-gpu mode: every channel between virtual nodes fails (or is `forbidden`), the
# same channel inside a node works, honest inter-node candidates are `ok` under both policies; at W = 4 on 2
# nodes (every channel across and inside), W = 8 on 2 and on 4 nodes (every channel across, the CUDA channels
# inside too, the honest ones). One line per (candidate, how, W, nodes); the files under $OUT (OUT defaults to .):
#   node_isolation.txt (everything printed), node_isolation_shared-gpu_w<W>n<N>.jsonl (one result per line).
# Under 8 minutes: each topology has a time budget (NODE_BUDGETS_S, default "190 115 115"); what a budget cuts
# is printed as NOT RUN, never left out silently. Exit status 1 if any line is FAIL or NOT RUN.
#   bash benchmarks/node_isolation/gpu.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
MODE="${NODE_MODE:-shared-gpu}"
mkdir -p "$OUT"
read -r budget_4x2 budget_8x2 budget_8x4 <<< "${NODE_BUDGETS_S:-190 115 115}"
status=0
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  uname -r; id -u
  python3 -c "from pkb.runtime.sandbox import offered; print(offered('auto').describe())"
} 2>&1 | tee "$OUT/node_isolation.txt"
for spec in "4x2 $budget_4x2 --inside all" "8x2 $budget_8x2 --inside cuda" "8x4 $budget_8x4 --inside cuda"; do
  set -- $spec
  topology="$1"; budget="$2"; shift 2
  python3 benchmarks/node_isolation/run.py --mode "$MODE" --topology "$topology" --budget-s "$budget" \
    --out "$OUT" "$@" 2>&1 | grep -v -e "FutureWarning" -e "return func(\*args" | tee -a "$OUT/node_isolation.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
echo "== node isolation: exit $status" | tee -a "$OUT/node_isolation.txt"
exit $status
