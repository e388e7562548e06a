"""PrefixRouter: prefix affinity first, then the least loaded, within a load margin."""

from __future__ import annotations

import pytest

from cellbatch.distributed.routing import LEAST_LOADED, PREFIX, PrefixRouter, Route

SHARED = list(range(100, 148))  # three whole blocks of 16


def route(router: PrefixRouter, prompt: list[int], weight: int = 1, **options) -> Route:
    chosen = router.choose(prompt, **options)
    router.started(chosen, prompt, weight)
    return chosen


def test_without_history_the_least_loaded_replica_takes_it_lowest_index_first() -> None:
    router = PrefixRouter(3)
    assert route(router, [1, 2, 3]) == Route(0, LEAST_LOADED, 0)
    assert route(router, [4, 5, 6]) == Route(1, LEAST_LOADED, 0)
    router.ended(0, 1)
    assert route(router, [7, 8, 9]).replica == 0
    assert router.load == [1, 1, 0]


def test_a_shared_prefix_goes_back_to_the_replica_that_served_it() -> None:
    router = PrefixRouter(2)
    route(router, [9] * 40)  # replica 0 is busier now
    first = route(router, [*SHARED, 1, 2])
    assert first.replica == 1
    again = route(router, [*SHARED, 3, 4, 5])
    assert again == Route(1, PREFIX, 48)
    assert router.routed[1, PREFIX] == 1 and router.routed[1, LEAST_LOADED] == 1


def test_the_longest_remembered_prefix_wins_and_partial_blocks_do_not_count() -> None:
    router = PrefixRouter(2, max_imbalance=10)
    route(router, SHARED[:16] + [7] * 16)  # one block in common with SHARED: replica 0
    router.started(Route(1, LEAST_LOADED, 0), SHARED, 1)  # all three blocks: replica 1
    assert router.choose([*SHARED, 5]) == Route(1, PREFIX, 48)
    assert router.choose(SHARED[:16] + [8] * 16) == Route(1, PREFIX, 16)  # the latest owner
    assert router.choose(SHARED[:15]).reason == LEAST_LOADED  # under one block


def test_affinity_yields_to_the_least_loaded_beyond_the_imbalance_margin() -> None:
    router = PrefixRouter(2, max_imbalance=2)
    replicas = [route(router, [*SHARED, i]).replica for i in range(8)]
    # Replica 0 keeps the prefix until it carries 3 more than replica 1, and so on.
    assert replicas[:4] == [0, 0, 0, 1]
    assert max(router.load) - min(router.load) <= 3


def test_down_replicas_are_avoided_while_another_is_left() -> None:
    router = PrefixRouter(2)
    route(router, SHARED)
    assert router.choose(SHARED, down={0}) == Route(1, LEAST_LOADED, 0)
    assert router.choose([1], down={0, 1}).replica in (0, 1)  # all down: Ray queues the call


def test_forgetting_a_replica_drops_its_prefixes_only() -> None:
    router = PrefixRouter(2, max_imbalance=10)
    route(router, SHARED)
    router.started(Route(1, LEAST_LOADED, 0), [5] * 32, 1)
    router.forget(0)
    assert router.choose(SHARED).reason == LEAST_LOADED
    assert router.choose([5] * 32) == Route(1, PREFIX, 32)


def test_the_prefix_table_is_bounded_and_least_recently_used_goes_first() -> None:
    router = PrefixRouter(2, block_tokens=4, max_prefixes=3, max_imbalance=10)
    route(router, [1, 1, 1, 1, 2, 2, 2, 2])  # two keys
    route(router, [3, 3, 3, 3])  # replica 1 (least loaded), a third key
    router.choose([1, 1, 1, 1])  # a hit refreshes [1,1,1,1]
    route(router, [4, 4, 4, 4])  # evicts the least recently used: [1..,2..]
    assert router.choose([1, 1, 1, 1, 2, 2, 2, 2]) == Route(0, PREFIX, 4)
    assert router.choose([3, 3, 3, 3]).reason == PREFIX


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        PrefixRouter(0)
    with pytest.raises(ValueError, match="max_imbalance"):
        PrefixRouter(2, max_imbalance=-1)
