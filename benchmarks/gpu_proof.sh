#!/usr/bin/env bash
# Everything the GPU issue asks to prove, in one go on a device machine; output under ${OUT:-.}/.
# Multicast stays off: these variables are set for every process started here.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-.}"
{
  echo "== $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  nvidia-smi topo -m 2>/dev/null | head -5
} 2>&1 | tee "$OUT/gpu_env.txt"
python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
python3 benchmarks/gpu_timing.py 2>&1 | tee "$OUT/gpu_timing.txt"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python3 -m pkb.cli run --problems collectives --mode cuda --world-size 2 --perf --trials 3 \
      --db "$OUT/cuda_w2.sqlite" 2>&1 | tee "$OUT/cuda_w2_run.txt"
fi
