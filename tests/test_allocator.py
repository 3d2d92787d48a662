import pytest

from kvpool.allocator import PageAllocator
from kvpool.lru import LruList


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


def test_lru_order_touch_and_remove_from_the_middle():
    lru = LruList(5)
    for p in [3, 1, 4, 0]:
        lru.push_mru(p)
    assert list(lru.iter_lru()) == [3, 1, 4, 0]
    lru.touch(1)
    assert list(lru.iter_lru()) == [3, 4, 0, 1]
    lru.remove(4)
    assert list(lru.iter_lru()) == [3, 0, 1]
    assert len(lru) == 3 and 4 not in lru and 0 in lru
