"""Solution folders written for upstream's earlier revision (issue 19): files are matched to problems by name,
not by their old numbers, and ``pkb run``'s notes say which mapping each got."""

from __future__ import annotations

from pathlib import Path

import pytest


def matched(folder: Path, files: dict[str, str | None]) -> list[str]:
    """Put ``files`` (name -> the slug it must land on, None: on none) in ``folder``, check where each lands;
    the notes ``pkb run`` prints about them."""
    from pkb.solution_files import solution_files

    for name in files:
        (folder / name).write_text("def solution(*args):\n    pass\n")
    notes: list[str] = []
    found = solution_files(folder, notes)
    for name, slug in files.items():
        holder = next((s for s, paths in found.items() if folder / name in paths), None)
        assert holder == (slug or "__unknown__"), (name, holder)
    return notes


def test_solution_files_are_matched_by_name_not_by_their_old_numbers(tmp_path):
    names = {"34_ulysses_all_to_all_tensor_primitive_cuda.py": "ulysses_all_to_all_tensor_primitive",
             "88_distributed_sample_sort_triton.py": "distributed_sample_sort",
             "11_allgather_gemm_AT_cuda.py": "allgather_gemm_at", "12_allgather_gemm.py": "allgather_gemm",
             "1_allreduce_cuda_peer.py": "allreduce", "layernorm_backward_mine.py": "layernorm_backward",
             "46_fsdp_adamw_sharded_cuda.py": None, "40_no_such_problem.py": None}
    notes = matched(tmp_path, names)
    assert any(n.startswith("34_ulysses_all_to_all_tensor_primitive_cuda.py -> 33 ") and "earlier upstream revision" in n
               for n in notes), notes
    assert any("46_fsdp_adamw_sharded_cuda.py: not evaluated" in n and "dropped" in n for n in notes), notes
    assert any("40_no_such_problem.py: not evaluated: its name matches no problem" in n for n in notes), notes
    assert not any(n.startswith("12_allgather_gemm.py") for n in notes)  # a plain match needs no note


# Every problem upstream renamed or renumbered, as files of a folder written for its earlier revision
# (number and name as they were then) and of today's (in the catalogue's numbering).
EARLIER_REVISION_FILES = {
    "11_gemm_allgather_AT_cuda.py": "allgather_gemm_at", "12_gemm_allgather_cuda.py": "allgather_gemm",
    "14_gemm_allscatter_cuda.py": "gemm_allgather", "18_rms_norm_triton.py": "tp_rms_norm",
    "34_ulysses_all_to_all_tensor_primitive.py": "ulysses_all_to_all_tensor_primitive",
    "46_reducescatter_fused_rmsnorm.py": "reducescatter_fused_rmsnorm", "47_fsdp_adamw_sharded.py": None,
    "48_fsdp_step_e2e.py": "fsdp_step_e2e", "88_conv2d_boundary_exchange_cuda.py": "conv2d_boundary_exchange",
}
TODAYS_FILES = {
    "11_allgather_gemm_AT.py": "allgather_gemm_at", "12_allgather_gemm.py": "allgather_gemm",
    "14_gemm_allgather.py": "gemm_allgather", "18_tp_rms_norm.py": "tp_rms_norm", "46_gemv_decode.py": "gemv_decode",
    "33_ulysses_all_to_all_tensor_primitive.py": "ulysses_all_to_all_tensor_primitive",
    "47_fsdp_step_e2e.py": "fsdp_step_e2e", "87_conv2d_boundary_exchange.py": "conv2d_boundary_exchange",
    "gemm_allgather_mine.py": "gemm_allgather", "rms_norm.py": "tp_rms_norm",
}


@pytest.mark.parametrize("files", [EARLIER_REVISION_FILES, TODAYS_FILES], ids=["earlier revision", "today"])
def test_every_renamed_or_renumbered_problem_lands_where_its_file_was_written_for(tmp_path, files):
    notes = matched(tmp_path, files)
    said = {note.split(" ")[0].rstrip(":"): note for note in notes}
    if files is EARLIER_REVISION_FILES:  # every file of the old folder says which mapping it got
        assert "upstream's earlier revision (12 gemm_allgather; now 12 allgather_gemm)" in said["12_gemm_allgather_cuda.py"]
        assert "(14 gemm_allscatter; now 14 gemm_allgather)" in said["14_gemm_allscatter_cuda.py"]
        assert "dropped" in said["47_fsdp_adamw_sharded.py"]
        assert "its number 88 is from an earlier upstream revision" in said["88_conv2d_boundary_exchange_cuda.py"]
        assert set(said) == set(files)
    else:  # today's numbers need no note; a name that meant another problem before says so
        assert set(said) == {"gemm_allgather_mine.py", "rms_norm.py"}, notes
        assert "problem 12's name in upstream's earlier revision" in said["gemm_allgather_mine.py"]
