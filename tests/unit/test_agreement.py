"""Replicas agree (pkb.evaluate.agreement): where the reference's ranks hold the same tensor, the candidate's must too;
a scalar the reference's ranks hold equal by chance (each rank's own bf16 loss) is no replica."""

from __future__ import annotations

import torch

from pkb.evaluate.agreement import MIN_REPLICA_ELEMENTS, disagreement


def test_ranks_that_disagree_on_a_replicated_tensor_fail_and_a_chance_equal_scalar_is_not_replicated():
    reduced = torch.arange(MIN_REPLICA_ELEMENTS, dtype=torch.float32)
    expected = [{"out": reduced.clone(), "loss": torch.tensor(10.5, dtype=torch.bfloat16)} for _ in range(4)]
    own_order = reduced.clone()
    own_order[3] = torch.nextafter(own_order[3], torch.tensor(100.0))
    got = [{"out": reduced.clone(), "loss": torch.tensor(10.5 + 0.0625 * rank, dtype=torch.bfloat16)}
           for rank in range(4)]
    assert disagreement(expected, got, "out") is None  # the losses differ, but equal scalars prove no replication
    got[2]["out"] = own_order
    found = disagreement(expected, got, "out")
    assert found is not None and "ranks 0 and 2 disagree in 1 of 8 elements" in found.reason, found
