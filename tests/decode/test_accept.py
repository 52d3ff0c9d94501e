"""The accept stage as a pure function of tensors, and commit's writes + rollback on a small decode state."""

from __future__ import annotations

import torch

from mtp.decode.accept import accept
from mtp.verify import Verdict


def verdict(accept_len, next_token):
    a = torch.tensor(accept_len)
    return Verdict(a, torch.tensor(next_token), torch.zeros_like(a))


def test_accepted_prefix_then_the_target_token():
    drafts = torch.tensor([[11, 12, 13], [21, 22, 23], [31, 32, 33], [41, 42, 43]])
    v = verdict([2, 0, 3, 1], [90, 91, 92, 93])
    active = torch.tensor([True, True, True, False])
    acc = accept(drafts, v, active, stop_ids=torch.tensor([2]), room_B=torch.tensor([10, 10, 10, 10]))
    assert acc.new_BK1[0, :3].tolist() == [11, 12, 90]
    assert acc.new_BK1[1, :1].tolist() == [91]
    assert acc.new_BK1[2].tolist() == [31, 32, 33, 92]  # every draft accepted: the bonus token last
    assert acc.keep_B.tolist() == [3, 1, 4, 0]  # a finished row commits nothing
    assert acc.accepted_B.tolist() == [2, 0, 3, 0]
    assert acc.kept_BK1.sum(1).tolist() == acc.keep_B.tolist()
    assert not acc.stopped_B.any()


def test_cut_at_the_first_stop_token_and_at_the_budget():
    drafts = torch.tensor([[5, 2, 7], [5, 6, 7], [2, 6, 7]])
    v = verdict([3, 3, 0], [8, 8, 2])
    acc = accept(drafts, v, torch.tensor([True, True, True]), stop_ids=torch.tensor([2]),
                 room_B=torch.tensor([10, 2, 10]))
    assert acc.keep_B.tolist() == [2, 2, 1]  # row 0 stops at its draft 2; row 1 has room for 2; row 2: target's 2
    assert acc.stopped_B.tolist() == [True, False, True]
    # a stop token past the accepted prefix is not a stop
    acc = accept(torch.tensor([[5, 2, 7]]), verdict([0], [9]), torch.tensor([True]), torch.tensor([2]),
                 torch.tensor([10]))
    assert acc.keep_B.tolist() == [1] and not acc.stopped_B.any()


def test_no_drafts_is_plain_decoding():
    acc = accept(torch.zeros(2, 0, dtype=torch.long), verdict([0, 0], [4, 2]), torch.tensor([True, True]),
                 torch.tensor([2]), torch.tensor([3, 3]))
    assert acc.new_BK1.tolist() == [[4], [2]] and acc.keep_B.tolist() == [1, 1]
    assert acc.stopped_B.tolist() == [False, True]
