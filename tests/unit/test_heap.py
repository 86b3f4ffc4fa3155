"""freeze_startup_heap: start-up objects leave the collector's scans; garbage made after still goes."""

import gc
import weakref

from core.heap import freeze_startup_heap


class Node:
    pass


def test_startup_heap_is_frozen_and_later_garbage_still_collected():
    num_frozen = freeze_startup_heap("test")
    try:
        assert num_frozen > 1000 and gc.get_freeze_count() > 1000  # pytest + torch's imports, at least
        node = Node()
        node.me = node  # a cycle: only the collector frees it
        gone = weakref.ref(node)
        del node
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
