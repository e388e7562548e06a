"""The batch worker's session slots: taken in turn, given back whatever ends a line."""

from __future__ import annotations

import asyncio

from cellbatch.server.batch_worker import Slots


def test_slots_go_first_come_first_served_and_a_cancelled_waiter_passes_its_turn() -> None:
    async def scenario() -> list[str]:
        slots = Slots(3)
        order: list[str] = []
        await slots.take(2)

        async def taker(name: str, count: int) -> None:
            await slots.take(count)
            order.append(name)

        big = asyncio.create_task(taker("big", 3))
        small = asyncio.create_task(taker("small", 1))
        gone = asyncio.create_task(taker("gone", 3))
        await asyncio.sleep(0)
        assert order == []  # one slot is free, but "big" came first and waits for three
        gone.cancel()
        slots.give(2)
        await asyncio.sleep(0)
        assert order == ["big"] and slots.free == 0
        slots.give(3)
        await asyncio.gather(small, return_exceptions=True)
        assert order == ["big", "small"] and slots.free == 2  # "gone" took nothing
        assert big.done() and gone.cancelled()
        return order

    asyncio.run(scenario())
