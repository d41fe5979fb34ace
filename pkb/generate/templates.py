"""Every piece of text pkb sends to a model, in one place. Nothing here names a problem: the blanks
are filled from the problem object, the hardware profile and the evaluator's result
(``pkb.generate.prompt``). Change the wording here and every prompt changes with it."""

SYSTEM = """\
You are an expert in multi-GPU programming: CUDA, Triton, NVLink peer memory, symmetric memory, \
and the collective algorithms of NCCL. You write correct, fast, self-contained Python files."""

TASK = """\
# Task: {name}

Write a faster drop-in replacement for the PyTorch + torch.distributed reference below
({source}). Your file defines `solution({arguments})`. It is imported once on each of the
{world_size} ranks, after the process group exists (one process per GPU, `dist.get_rank()`,
`dist.get_world_size()`); then every rank calls `solution(...)` with its own inputs on its own GPU,
and each call must return on every rank what the reference returns on that rank. The file must
work at every world size the problem runs at ({world_sizes}); it is checked at several.

{backend_goal}
{communication}
"""

COMMUNICATION = """\
Use torch.distributed only for setup (rank, world size, the group a symmetric buffer lives in);
do the communication itself in your own kernels, reading and writing peers' memory directly."""

# On several nodes (pkb.topology): peer memory inside a node, torch.distributed between nodes.
COMMUNICATION_NODES = """\
Inside a node, do the communication in your own kernels, reading and writing peers' memory directly
(symmetric memory over a group whose ranks share the node, such as `intra_group`); there use
torch.distributed only for setup. Between nodes only torch.distributed moves data (the network): call
it over groups whose ranks sit on different nodes (such as `inter_group`), or point to point to a rank
on another node. Peer memory, CUDA IPC handles and host memory do not reach another node."""

NO_NVLINK_LEG = """\
Nothing in this problem has to cross NVLink: every byte it moves goes between nodes, so torch.distributed
carries all of it. Your kernels do the rest: pack and unpack what is sent, in as few and as large messages as
the layout allows, and overlap the transfers with that work."""


PRECISION = """\
## Precision: {precision}

This run's precision is {precision} ({dtype}): every case builds in it the inputs that the upstream
benchmark builds from its precision argument; indices, scales and other dtypes that are part of the
function stay as the reference shows them. Optimise for {precision}; a kernel that only works in
another precision fails.
"""

BACKEND_GOALS = {
    "cuda": "Write the kernels in CUDA C++, built at import time with `pkb.kernels.load_cuda`.",
    "triton": "Write the kernels in Triton (`import triton`, `import triton.language as tl`).",
}

HARDWARE = """\
## Hardware: {name} ({description})

- {num_gpus} x {gpu_model}, connected by {interconnect}: {link_gbps} GB/s per direction per GPU,
  about {latency_us} us latency for a small transfer.
- NVLink multicast (NVLS, multimem instructions): {nvls}.
- Per GPU: {hbm} of HBM at {hbm_gbps} GB/s, {l2} of L2 cache, {bf16_tflops} TFLOP/s dense bf16,
  {fp8_tflops} TFLOP/s dense fp8.
"""

ROOFLINE = """
On this hardware that is at least {bound_us:.3g} us per call ({bound_by}-bound: link {link_us:.3g} us, \
{network}latency {latency_us:.3g} us, compute {compute_us:.3g} us, HBM {memory_us:.3g} us)."""

TOPOLOGY = """## Topology: {num_nodes} nodes

{description} The function receives its process groups for both dimensions among its arguments \
(`pkb.kernels.topology.node_groups()` gives the same; `pkb.kernels.topology.current()` the topology). \
Every byte that crosses between nodes costs far more than one that stays on NVLink: send each only once \
per node, then forward it inside the node.
"""

NVLS_YES = ("in the hardware, but hosts often run with it switched off (NCCL_NVLS_ENABLE=0, "
            "TORCH_SYMM_MEM_DISABLE_MULTICAST=1): use it only with a fallback that works without it")
NVLS_NO = "not available here: do not use multicast objects or multimem instructions"

REFERENCE = """\
## Reference (`{module}`)

```python
{source}
```
"""

HELPER_MODULE = """\
The reference imports from `{module}`:

```python
{source}
```
"""

CASE = """\
## Inputs: case `{case}` at world size {world_size}{note}

Case parameters: {params}. Each rank's inputs (dtype[shape]):
{ranks}

Correctness is checked on every rank, over several trials with fresh random inputs (distinct per
rank and per trial, never constant), on these small cases: {tests}. Timing uses {timed}, with fresh
input copies on every call: nothing computed in one call may be reused in the next.
Cost of one call per rank (the problem's own model): {cost}.{roofline}
"""

TOLERANCE = """\
## Correctness

Outputs must have the reference's structure, shapes and dtypes; integer and bool outputs must match
exactly. {floats} Inputs must end as the reference leaves them (do not modify an input the reference
leaves alone).
"""

# How floating outputs are judged: against the exact answer (pkb.evaluate.accuracy), or by the tolerance alone
FLOATS_EXACT = """Floating outputs are judged against the exact answer (the reference run again in {exact} on
the same inputs): an answer passes when its error is at most {factor:g}x the reference's own error, element by
element (or within atol + rtol * |exact|: {tolerances}) and over each tensor (its RMS, and its systematic
bias), with NaN and inf where the reference has them. Summing in another order or in a higher precision
passes; a biased, compressed (e.g. fp8 on the wire) or lossy answer does not."""

FLOATS_TOLERANCE = """Floating outputs must satisfy |got - expected| <= atol + rtol * |expected| against the
reference's outputs, element by element ({tolerances}), with NaN and inf in the same places ({note})."""

HELPERS = """\
## Helpers your file may import (`pkb.kernels`)

{doc}
Signatures:
{signatures}
"""

EXAMPLE = """\
## Worked example: the reference of `{name}` and a solution that does its communication on the device

Reference:

```python
{reference}
```

Solution (`{solution_file}`):

```python
{solution}
```

It imports these shared pieces, which your file may import too (`{common_module}`):

```python
{common}
```
"""

ANSWER_FORMAT = """\
## Answer format

Reply with exactly one ```python code block holding the whole file. The file must:
- define `solution({arguments})`, the reference's argument list, returning what the reference returns;
- declare `REQUIRES = ("cuda",)` at top level;
- build any CUDA source at import time (it is built once and cached, before anything is timed);
- allocate symmetric buffers once (e.g. cached by size and dtype), not on every call: the
  allocation is collective, so every rank must make the same allocations in the same order.
"""

FEEDBACK = """\
Your last file (step {step}) was evaluated: **{status}**.

{body}

Reply with the complete improved file in one ```python code block defining `solution({arguments})`.
"""

FEEDBACK_NO_CODE = """\
Your answer had no ```python code block defining `solution`. Nothing could be evaluated."""

FEEDBACK_OK = """\
It is correct on every rank ({message}).
{timings}{roofline}
Make it faster while keeping it correct. The best correct file so far is kept whatever you answer."""

FEEDBACK_TIMING = "{case}: reference {reference_us:.1f} us, yours {candidate_us:.1f} us, speedup {speedup:.2f}x\n"

FEEDBACK_NOT_GPU = "(These times were measured in {mode} mode and are not GPU performance.)\n"

FEEDBACK_FAILED = """\
{message}
{details}
Fix it. The best correct file so far is kept whatever you answer."""
