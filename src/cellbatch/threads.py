"""One OpenMP team per process: torch work off the engine thread runs on short-lived threads.

Owns: `in_short_lived_thread`, which runs a function on a fresh thread and returns its
result (or raises its exception) in the caller.
Why: with torch's OpenMP backend (libgomp), every thread that runs parallel torch ops
keeps its own team of worker threads for as long as it lives. Once the process holds
more OpenMP threads than CPUs, libgomp stops spinning between parallel regions in
every team, and a decode step on the engine thread slows down by about half again.
Work such as model loading therefore runs on a thread that exits
(taking its team with it), so the engine thread's team is the only one left.
Never: runs anything concurrently with the caller; it waits for the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_short_lived_thread(function: Callable[[], T]) -> T:
    """function() on a new thread that exits before this returns."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # re-raised in the caller, whatever it was
            outcome["error"] = error

    worker = threading.Thread(target=run, name="cellbatch-load")
    worker.start()
    worker.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
