"""Temporary: run every benchmark case of the expert_parallel problems once at W=2 on GPUs (NCCL)."""
import os, socket, sys, time, traceback
import torch, torch.distributed as dist, torch.multiprocessing as mp
from pkb.problem import make_generator
from pkb.registry import all_problems

def describe(x):
    if isinstance(x, torch.Tensor):
        f = x.float() if x.is_floating_point() else x
        extra = f" finite={bool(torch.isfinite(f).all())} std={f.std().item():.3g}" if x.is_floating_point() and x.numel() > 1 else ""
        return f"{x.dtype}{list(x.shape)}{extra}"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(describe(v) for v in x) + ")"
    return repr(x)[:40]

def run(rank, W, port, only):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=W, device_id=torch.device("cuda", rank))
    for p in all_problems().values():
        if p.category != "expert_parallel" or (only and p.name not in only):
            continue
        for case in p.benchmarks:
            try:
                t0 = time.time()
                inputs = p.make_inputs(case, rank, W, make_generator(1 + rank, 77, f"cuda:{rank}"))
                torch.cuda.synchronize(); t1 = time.time()
                out = p.reference(*inputs)
                torch.cuda.synchronize(); t2 = time.time()
                out = p.reference(*inputs)
                torch.cuda.synchronize(); t3 = time.time()
                mem = torch.cuda.max_memory_allocated() / 2**30
                if rank == 0:
                    print(f"{p.name}/{case.name}: inputs {t1-t0:.2f}s ref {t2-t1:.2f}s/{t3-t2:.3f}s peak {mem:.1f}GiB out {describe(out)}", flush=True)
            except Exception:
                print(f"FAIL rank{rank} {p.name}/{case.name}\n{traceback.format_exc()}", flush=True)
            del inputs
            out = None
            torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
            dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    W = torch.cuda.device_count()
    mp.spawn(run, args=(W, port, sys.argv[1:]), nprocs=W)
