"""task_slot read page by page (sampler/kernel/membership.py,
nonzero_bytes) against numpy's own flatnonzero over every byte."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.kernel.membership import PAGE, nonzero_bytes


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, 3 * PAGE + 9), data=st.data())
def test_the_members_found_page_by_page_are_every_nonzero_byte(length: int, data: st.DataObject) -> None:
    shared = np.zeros(length, dtype=np.uint8)
    if length:
        at = data.draw(st.lists(st.integers(0, length - 1), max_size=40))
        shared[at] = data.draw(st.integers(1, 255))
    found = nonzero_bytes(shared)
    assert found.dtype.kind == "i" and found.tolist() == np.flatnonzero(shared).tolist()


def test_a_page_edge_and_the_tail_past_the_last_whole_page() -> None:
    shared = np.zeros(2 * PAGE + 5, dtype=np.uint8)
    at = [0, PAGE - 1, PAGE, 2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 4]
    shared[at] = 1
    assert nonzero_bytes(shared).tolist() == at
