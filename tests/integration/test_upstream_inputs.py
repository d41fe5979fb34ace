"""pkb's ``upstream`` cases hand a solution the same argument structure as upstream's factory (issue 28), and
the paper's verdict hands it upstream's very values (issue 47).

Upstream's ``create_input_tensor`` (``../shared/upstream/utils/input_output_tensors.py``, imported from
that file) runs beside ``problem.make_inputs`` on every pkb upstream case, rank by rank, in W gloo
processes on the CPU (the factory may create process groups), at M = N = 1024, trial 0, in bf16 at W = 2
and 4 and in fp32 and fp16 at W = 2 (the rest under ``slow``), the factory given the run's dtype. The two
argument tuples must agree in STRUCTURE: the number of positional arguments; per argument, recursively
through tuples, lists, dicts, dataclasses and modules: the type; for tensors the layout, shape, dtype,
stride (dims of size 1 left out: they address nothing), contiguity and requires_grad (for sparse
tensors also nnz and coalescing); None vs not None; Python scalars, strings, dtypes and
sizes by value; process groups by kind (WORLD or the ranks of a subgroup). Random data is not compared,
except the integer tensors that are sizes or counts (``COUNT_TENSORS``); an Adam step upstream derives
from the trial must be one of the values it takes (``TRIAL_STEPS``). One set of W processes per
world size serves every problem. The storage offset is not compared (``COMPARE_STORAGE_OFFSET``):
upstream's shards are often ``full[rank * n:(rank + 1) * n].contiguous()``, a view at an offset into
the whole tensor, and a solution that addresses a tensor through ``data_ptr()`` (as every kernel
does) cannot tell. Skipped where the upstream folder is absent (a user's clone has no
../shared).

VALUES: ``Problem.upstream_inputs`` (the inputs of the paper's verdict) must give, for every upstream case,
exactly the factory's tensors, bit for bit, and its other arguments (scalars, groups, modules' parameters
and buffers, dataclasses' fields) equal, at W = 2 with trial 0 and at W = 4 with trial 3 (so that the trial's
term of upstream's seed is checked too), in bf16, and at W = 2 in fp32 and fp16; the rest under ``slow``.
The factory and pkb's function run one after the other in the same rank process, each seeding the process's
generators itself, as upstream's worker does.

Run one problem with ``-k "28-"`` (ids ``<n>-<W>`` in bf16, ``<n>-<W>-fp32`` and ``-fp16`` in the others; the
values test's are ``u<n>-w<W>-<precision>-t<trial>``).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import multiprocessing
import os
import tempfile
import traceback

import pytest
import torch

from pkb.registry import all_problems
from helpers.upstream import UPSTREAM

FACTORY = UPSTREAM / "utils" / "input_output_tensors.py"
BASE_SHAPE = (1024, 1024)
REPLY_TIMEOUT_S = 180.0

pytestmark = pytest.mark.skipif(not FACTORY.is_file(), reason=f"no upstream factory at {FACTORY}")

# Integer tensors whose VALUES are structure (sizes or counts a solution may size buffers or loops from),
# by problem and top-level argument position, with the reason. Every other tensor's values are data.
COUNT_TENSORS: dict[int, dict[int, str]] = {
    23: {1: "local_valid: the number of valid tokens on this rank",
         2: "global_valid: the number of valid tokens on all ranks"},
    28: {5: "num_global_tokens_per_local_expert: rows each rank sends to each local expert"},
    29: {6: "num_global_tokens_per_local_expert: rows each rank sends to each local expert"},
    77: {2: "k_ranges: [start, end) token ranges of the key chunks"},
    80: {2: "n_masked: the number of masked rows"},
}

# Arguments whose shape follows random values upstream (its length is a sum of random lengths): only
# their number of dims is compared.
DATA_DEPENDENT_SHAPES: dict[int, dict[int, str]] = {
    70: {1: "values: its length is the sum of the random per-sample lengths"},
}

# Python ints that upstream derives from the trial: an Adam step of ``1 + trial % 7``. This test builds trial
# 0; pkb's make_inputs is not told the trial and draws the step from the same values, the same on every rank.
TRIAL_STEPS: dict[int, dict[int, str]] = {
    40: {18: "step"}, 41: {12: "step"}, 42: {12: "step"}, 43: {8: "step"}, 47: {11: "step"},
}
UPSTREAM_STEPS = range(1, 8)  # 1 + trial % 7

COMPARE_STORAGE_OFFSET = os.environ.get("PKB_COMPARE_STORAGE_OFFSET") == "1"  # set it to list the differences

# Problems whose upstream inputs are too large to allocate here: both sides are built under
# FakeTensorMode (shapes, dtypes and strides without storage), so pkb's make_inputs must build its upstream
# case without reading random values back (no ``.item()`` on them), as ``pkb show`` needs anyway.
NOT_ALLOCATED: dict[int, str] = {
    68: "upstream's embedding shard is 111M/W x 256 bf16 rows (about 28 GiB per rank at W = 2)",
}


# (world size, precision): bf16, the paper's, at 2 and 4 (8 under slow); the other precisions at 2
RUNS = ((2, "bf16"), (4, "bf16"), (2, "fp32"), (2, "fp16"), (8, "bf16"), (4, "fp32"), (4, "fp16"))


def _upstream_params():
    params = []
    for world_size, precision in RUNS:
        marks = (pytest.mark.slow,) if world_size == 8 or (world_size, precision) in ((4, "fp32"), (4, "fp16")) else ()
        for problem in all_problems().values():
            if problem.upstream_id and world_size in problem.world_sizes and precision in problem.precisions:
                params.append(pytest.param(problem.upstream_id, world_size, precision, marks=marks,
                                           id=f"{problem.upstream_id}-{world_size}" + ("" if precision == "bf16"
                                                                                       else f"-{precision}")))
    return params


# -- what a value looks like, without its data ---------------------------------------------------------


def _stride(tensor: torch.Tensor) -> tuple:
    return tuple(s if n > 1 else "-" for s, n in zip(tensor.stride(), tensor.shape))


def _describe_tensor(tensor: torch.Tensor, shape_is_data: bool, values_are_counts: bool) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    shape = f"<{tensor.dim()} dims>" if shape_is_data else list(tensor.shape)
    if tensor.layout is not torch.strided:
        parts = [f"{tensor.layout} {dtype}{shape}", f"nnz={tensor._nnz()}", f"coalesced={tensor.is_coalesced()}"]
    else:
        parts = [f"tensor {dtype}{shape}"]
        if not shape_is_data:
            parts.append(f"stride={_stride(tensor)}")
        if COMPARE_STORAGE_OFFSET:
            parts.append(f"offset={tensor.storage_offset()}")
        parts.append("contiguous" if tensor.is_contiguous() else "NON-contiguous")
    if tensor.requires_grad:
        parts.append("requires_grad")
    if values_are_counts:
        parts.append(f"values={tensor.tolist()}")
    return ", ".join(parts)


def _describe_group(group) -> str:
    import torch.distributed as dist

    if group is dist.group.WORLD:
        return "process group WORLD"
    return f"process group ranks={dist.get_process_group_ranks(group)}"


def flatten(value, path: str, out: list, counts: bool = False, shape_is_data: bool = False) -> None:
    """Append ``(path, description)`` for ``value`` and everything inside it."""
    import torch.distributed as dist

    if isinstance(value, torch.Tensor):
        out.append((path, _describe_tensor(value, shape_is_data, counts)))
    elif value is None or isinstance(value, (bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)):
        out.append((path, f"{type(value).__name__} {value!r}"))
    elif isinstance(value, dist.ProcessGroup):
        out.append((path, _describe_group(value)))
    elif isinstance(value, (tuple, list)):
        out.append((path, f"{type(value).__name__} of {len(value)}"))
        for index, item in enumerate(value):
            flatten(item, f"{path}[{index}]", out, counts, shape_is_data)
    elif isinstance(value, dict):
        out.append((path, f"{type(value).__name__} keys={sorted(map(repr, value))}"))
        for key in value:
            flatten(value[key], f"{path}[{key!r}]", out, counts, shape_is_data)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.append((path, f"dataclass {type(value).__qualname__}"))
        for item in dataclasses.fields(value):
            flatten(getattr(value, item.name), f"{path}.{item.name}", out, counts, shape_is_data)
    elif isinstance(value, torch.nn.Module):
        out.append((path, f"module {type(value).__qualname__} training={value.training}"))
        for name, tensor in list(value.named_parameters()) + list(value.named_buffers()):
            flatten(tensor, f"{path}.{name}", out, counts, shape_is_data)
    else:
        out.append((path, f"object {type(value).__module__}.{type(value).__qualname__}"))


def describe_arguments(args: tuple, names: tuple[str, ...], number: int) -> list:
    out = [("", f"{len(args)} positional arguments")]
    for index, value in enumerate(args):
        name = names[index] if index < len(names) else "?"
        if index in TRIAL_STEPS.get(number, {}) and type(value) is int:
            out.append((f"[{index}] {name}", "int 1 + trial % 7" if value in UPSTREAM_STEPS
                        else f"int {value!r} (not 1 + trial % 7)"))
            continue
        flatten(value, f"[{index}] {name}", out, counts=index in COUNT_TENSORS.get(number, {}),
                shape_is_data=index in DATA_DEPENDENT_SHAPES.get(number, {}))
    return out


# -- the rank processes --------------------------------------------------------------------------------


def _load_factory():
    spec = importlib.util.spec_from_file_location("upstream_input_output_tensors", FACTORY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.create_input_tensor


def _both_structures(create_input_tensor, number: int, rank: int, world_size: int, precision: str) -> dict:
    """This rank's structure from upstream's factory and from every pkb upstream case in ``precision`` (or
    the error)."""
    from pkb.problem import PRECISIONS, make_generator
    from pkb.registry import get_problem

    problem = get_problem(number)
    fake = None
    if number in NOT_ALLOCATED:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode
    reply: dict = {"pkb": {}}
    try:
        with fake() if fake else _nothing():
            args = create_input_tensor(rank, world_size, number, BASE_SHAPE, PRECISIONS[precision], trial=0,
                                       device="cpu")
            reply["upstream"] = describe_arguments(tuple(args), problem.argument_names, number)
    except Exception:
        reply["upstream"] = "upstream's factory raised:\n" + traceback.format_exc(limit=4)
    for case in problem.cases("upstream", world_size, precision):
        try:
            gen = make_generator(1000 + 7919 * rank, 17)
            with fake() if fake else _nothing():
                args = problem.make_inputs(case, rank, world_size, gen)
                reply["pkb"][case.name] = describe_arguments(tuple(args), problem.argument_names, number)
        except Exception:
            built_as = " (under FakeTensorMode: see NOT_ALLOCATED)" if fake else ""
            reply["pkb"][case.name] = f"pkb's make_inputs raised{built_as}:\n" + traceback.format_exc(limit=4)
    return reply


def _both_values(create_input_tensor, number: int, rank: int, world_size: int, precision: str, trial: int,
                 device: str = "cpu") -> list[str]:
    """Where pkb's ``upstream_inputs`` differs from upstream's factory on this rank (empty: bit for bit), both
    drawing on ``device`` (``cuda:0`` for every rank: as in shared-gpu mode; upstream's own GPU of each rank draws
    from the same Philox stream)."""
    from pkb.problem import PRECISIONS, UPSTREAM_BASE_SHAPE
    from pkb.registry import get_problem

    problem = get_problem(number)
    if problem.upstream_inputs is None:
        return [f"{problem.name} has no upstream_inputs"]
    try:
        upstream = tuple(create_input_tensor(rank, world_size, number, UPSTREAM_BASE_SHAPE, PRECISIONS[precision],
                                             trial=trial, device=device))
    except Exception:
        return ["upstream's factory raised:\n" + traceback.format_exc(limit=4)]
    lines = []
    for case in problem.cases("upstream", world_size, precision):
        try:
            ours = problem.upstream_values(case, rank, world_size, trial, torch.device(device))
        except Exception:
            lines.append(f"case {case.name}: pkb's upstream_inputs raised:\n" + traceback.format_exc(limit=4))
            continue
        names = problem.argument_names
        if len(ours) != len(upstream):
            lines.append(f"case {case.name}: {len(ours)} arguments, upstream's factory gives {len(upstream)}")
        for index, (theirs, mine) in enumerate(zip(upstream, ours)):
            name = names[index] if index < len(names) else "?"
            lines += [f"case {case.name}: {line}" for line in value_diff(theirs, mine, f"[{index}] {name}")]
    return lines


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (NaNs compare by their bits)."""
    tensor = tensor.detach().cpu()
    if tensor.layout is not torch.strided:
        tensor = tensor.coalesce().values() if tensor.layout is torch.sparse_coo else tensor.to_dense()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    if tensor.dtype == torch.bool:
        return tensor
    return tensor.contiguous().view(_BITS[tensor.element_size()])


def value_diff(upstream, ours, path: str) -> list[str]:
    """Lines ``path: ...`` where ``ours`` is not upstream's value bit for bit (structure included)."""
    import torch.distributed as dist

    if type(ours) is not type(upstream) and not (isinstance(upstream, dist.ProcessGroup)
                                                 and isinstance(ours, dist.ProcessGroup)):
        return [f"{path}: upstream {type(upstream).__name__}, pkb {type(ours).__name__}"]
    if isinstance(upstream, torch.Tensor):
        if (upstream.dtype, upstream.shape, upstream.layout) != (ours.dtype, ours.shape, ours.layout):
            return [f"{path}: upstream {upstream.dtype}{list(upstream.shape)}, pkb {ours.dtype}{list(ours.shape)}"]
        if upstream.layout is torch.sparse_coo and not torch.equal(upstream.coalesce().indices(), ours.coalesce().indices()):
            return [f"{path}: the sparse indices differ"]
        same = _bits(upstream) == _bits(ours)
        if not bool(same.all()):
            first = int((~same).reshape(-1).nonzero()[0])
            theirs, mine = upstream.detach().cpu().reshape(-1), ours.detach().cpu().reshape(-1)
            shown = f" (first at flat index {first}: upstream {theirs[first].item()!r}, pkb {mine[first].item()!r})" \
                if theirs.numel() == same.numel() else ""
            return [f"{path}: {int((~same).sum())} of {same.numel()} values differ{shown}"]
        return []
    if isinstance(upstream, dist.ProcessGroup):
        theirs, mine = (_describe_group(group) for group in (upstream, ours))
        return [] if theirs == mine else [f"{path}: upstream {theirs}, pkb {mine}"]
    if isinstance(upstream, (tuple, list)):
        if len(upstream) != len(ours):
            return [f"{path}: upstream {len(upstream)} items, pkb {len(ours)}"]
        return [line for index, (a, b) in enumerate(zip(upstream, ours)) for line in value_diff(a, b, f"{path}[{index}]")]
    if isinstance(upstream, dict):
        if list(upstream) != list(ours):
            return [f"{path}: upstream keys {list(upstream)}, pkb {list(ours)}"]
        return [line for key in upstream for line in value_diff(upstream[key], ours[key], f"{path}[{key!r}]")]
    if dataclasses.is_dataclass(upstream) and not isinstance(upstream, type):
        return [line for item in dataclasses.fields(upstream)
                for line in value_diff(getattr(upstream, item.name), getattr(ours, item.name), f"{path}.{item.name}")]
    if isinstance(upstream, torch.nn.Module):
        theirs = dict(list(upstream.named_parameters()) + list(upstream.named_buffers()))
        mine = dict(list(ours.named_parameters()) + list(ours.named_buffers()))
        if list(theirs) != list(mine) or upstream.training != ours.training:
            return [f"{path}: upstream module {sorted(theirs)} (training={upstream.training}), "
                    f"pkb {sorted(mine)} (training={ours.training})"]
        return [line for name in theirs for line in value_diff(theirs[name], mine[name], f"{path}.{name}")]
    if upstream is None or isinstance(upstream, (bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)):
        return [] if upstream == ours or (upstream != upstream and ours != ours) else [f"{path}: upstream {upstream!r}, pkb {ours!r}"]
    return [f"{path}: cannot compare {type(upstream).__qualname__} values"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _rank_main(conn, rank: int, world_size: int, store_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S))
    create_input_tensor = _load_factory()
    while True:
        asked = conn.recv()
        if asked is None:
            break
        try:
            if asked[0] == "values":
                conn.send(_both_values(create_input_tensor, asked[1], rank, world_size, *asked[2:]))
            else:
                conn.send(_both_structures(create_input_tensor, *asked[:1], rank, world_size, asked[1]))
        except Exception:
            conn.send({"upstream": "worker failed:\n" + traceback.format_exc(), "pkb": {}})
    dist.destroy_process_group()


class RankPool:
    """W gloo processes that answer ``structures(number)`` with every rank's reply."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        context = multiprocessing.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="pkb-upstream-inputs-")
        store_path = os.path.join(self._dir.name, "store")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = context.Pipe()
            proc = context.Process(target=_rank_main, args=(child, rank, world_size, store_path), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self.broken = False

    def structures(self, number: int, precision: str) -> list[dict]:
        return self._ask((number, precision), number)

    def values(self, number: int, precision: str, trial: int, device: str = "cpu") -> list[list[str]]:
        return self._ask(("values", number, precision, trial, device), number)

    def _ask(self, asked: tuple, number: int) -> list:
        for conn in self._conns:
            conn.send(asked)
        replies = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(REPLY_TIMEOUT_S):
                self.broken = True
                raise TimeoutError(f"rank {rank} gave no answer for problem {number} within {REPLY_TIMEOUT_S:.0f} s")
            replies.append(conn.recv())
        return replies

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if not self.broken and proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
            proc.join(timeout=5 if not self.broken else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._dir.cleanup()


@pytest.fixture(scope="module")
def rank_pool():
    """``rank_pool(W)``: one RankPool per world size, kept for the module whatever order the tests run
    in (node ids given one by one alternate world sizes); a pool that timed out is replaced."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size in pools and pools[world_size].broken:
            pools.pop(world_size).close()
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


# -- the comparison ------------------------------------------------------------------------------------


def structure_diff(upstream, ours) -> list[str]:
    """Lines ``path: upstream X vs pkb Y`` where the two descriptions differ (or the error of either)."""
    if isinstance(upstream, str):
        return [upstream]
    if isinstance(ours, str):
        return [ours]
    up, mine = dict(upstream), dict(ours)
    lines = []
    for path in list(up) + [p for p in mine if p not in up]:
        if up.get(path) != mine.get(path):
            lines.append(f"{path or 'arguments'}: upstream {up.get(path, '(absent)')} vs pkb {mine.get(path, '(absent)')}")
    return lines


@pytest.mark.parametrize("number,world_size,precision", _upstream_params())
def test_upstream_case_inputs_have_the_structure_of_upstreams_factory(number, world_size, precision, rank_pool):
    from pkb.registry import get_problem

    problem = get_problem(number)
    replies = rank_pool(world_size).structures(number, precision)
    problems_found = []
    for rank, reply in enumerate(replies):
        assert reply["pkb"], f"{problem.name}: no upstream case at W={world_size}"
        for case_name, ours in reply["pkb"].items():
            for line in structure_diff(reply["upstream"], ours):
                problems_found.append(f"rank {rank}, case {case_name}: {line}")
    if problems_found:
        shown = problems_found[:40] + ([f"... and {len(problems_found) - 40} more"] if len(problems_found) > 40 else [])
        pytest.fail(f"{number} {problem.name} at W={world_size} in {precision}: pkb's upstream inputs differ from upstream's "
                    f"factory in {len(problems_found)} places:\n  " + "\n  ".join(shown), pytrace=False)


# (world size, precision, trial): in bf16 trial 0 at W = 2 and trial 3 at W = 4 (the seed's trial term); the others at 2
VALUE_RUNS = ((2, "bf16", 0), (4, "bf16", 3), (2, "fp32", 1), (2, "fp16", 2), (8, "bf16", 4), (4, "fp32", 0),
              (4, "fp16", 0))


def _value_params():
    params = []
    for world_size, precision, trial in VALUE_RUNS:
        slow = world_size == 8 or (world_size == 4 and precision != "bf16")
        for problem in all_problems().values():
            if problem.upstream_id and world_size in problem.world_sizes and precision in problem.precisions:
                marks = [pytest.mark.slow] if slow else []
                if problem.upstream_id in NOT_ALLOCATED:
                    marks.append(pytest.mark.skip(reason=f"too large to allocate: {NOT_ALLOCATED[problem.upstream_id]}"))
                params.append(pytest.param(problem.upstream_id, world_size, precision, trial, marks=marks,
                                           id=f"u{problem.upstream_id}-w{world_size}-{precision}-t{trial}"))
    return params


@pytest.mark.parametrize("number,world_size,precision,trial", _value_params())
def test_the_paper_verdicts_inputs_are_upstreams_values_bit_for_bit(number, world_size, precision, trial, rank_pool):
    from pkb.registry import get_problem

    problem = get_problem(number)
    replies = rank_pool(world_size).values(number, precision, trial)
    found = [f"rank {rank}: {line}" for rank, lines in enumerate(replies) for line in lines]
    if found:
        shown = found[:40] + ([f"... and {len(found) - 40} more"] if len(found) > 40 else [])
        pytest.fail(f"{number} {problem.name} at W={world_size} in {precision}, trial {trial}: pkb's upstream_inputs "
                    f"differ from upstream's factory in {len(found)} places:\n  " + "\n  ".join(shown), pytrace=False)


def _gpu_value_params():
    return [pytest.param(problem.upstream_id, world_size, trial, id=f"u{problem.upstream_id}-w{world_size}-gpu-t{trial}",
                         marks=[pytest.mark.skip(reason=f"too large: {NOT_ALLOCATED[problem.upstream_id]}")]
                         if problem.upstream_id in NOT_ALLOCATED else [])
            for world_size, trial in ((2, 0), (4, 3)) for problem in all_problems().values()
            if problem.upstream_id and world_size in problem.world_sizes]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("number,world_size,trial", _gpu_value_params())
def test_the_paper_verdicts_inputs_are_upstreams_values_bit_for_bit_on_a_gpu(number, world_size, trial, rank_pool):
    """The same, drawn on the GPU as shared-gpu and cuda modes draw them (every rank on cuda:0 here), in bf16."""
    replies = rank_pool(world_size).values(number, "bf16", trial, "cuda:0")
    found = [f"rank {rank}: {line}" for rank, lines in enumerate(replies) for line in lines]
    assert not found, f"{number} at W={world_size} on the GPU, trial {trial}:\n  " + "\n  ".join(found[:40])
