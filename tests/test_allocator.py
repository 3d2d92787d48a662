import pytest

from kvpool.allocator import PageAllocator
from kvpool.policies.links import SlotLists


def test_allocator_hands_out_in_order_then_reuses_last_freed_first():
    a = PageAllocator(4)
    assert [a.alloc() for _ in range(4)] == [0, 1, 2, 3]
    assert a.alloc() is None
    a.free(2)
    a.free(0)
    assert (a.num_free, a.num_used) == (2, 2)
    assert [a.alloc(), a.alloc(), a.alloc()] == [0, 2, None]


def test_double_free_is_an_invariant_violation():
    a = PageAllocator(2)
    p = a.alloc()
    a.free(p)
    with pytest.raises(AssertionError):
        a.free(p)


def test_slot_lists_order_move_and_remove_from_the_middle():
    lists = SlotLists(6, 2)
    for p in [3, 1, 4, 0]:
        lists.push_tail(0, p)
    lists.push_tail(1, 5)
    assert list(lists.iter_from_head(0)) == [3, 1, 4, 0]
    lists.move_to_tail(0, 1)
    assert list(lists.iter_from_head(0)) == [3, 4, 0, 1]
    assert list(lists.iter_from_tail(0)) == [1, 0, 4, 3]
    assert lists.remove(4) == 0 and lists.remove(4) == -1
    assert list(lists.iter_from_head(0)) == [3, 0, 1]
    lists.move_to_tail(1, 3)  # between lists
    assert list(lists.iter_from_head(1)) == [5, 3] and lists.head(0) == 0
    assert (lists.size(0), lists.size(1), len(lists)) == (2, 2, 4)
