"""Which replica serves a request: prefix affinity first, then the least loaded.

Owns: the load of each replica (the generations routed to it and not yet ended), a
bounded LRU from prompt prefixes (whole blocks of `block_tokens` tokens, each key
chained over the blocks before it) to the replica that last served them, and the
counts of routing decisions by replica and reason.
Promises: a prompt whose longest remembered prefix (at least one block) was served by a
live replica goes back to it, so that its prefix cache keeps working, unless that
replica carries more than `max_imbalance` generations beyond the least loaded live
one; otherwise the least loaded live replica takes it (ties: the lowest index). The
table never holds more than `max_prefixes` keys. Pure bookkeeping: no I/O, no Ray,
not thread-safe (the server's event loop is its one caller).
Never: sends anything to a replica.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cellbatch.types import Token

PREFIX = "prefix"
LEAST_LOADED = "least_loaded"


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # PREFIX or LEAST_LOADED
    matched_tokens: int  # of the prompt, found in the table for that replica (PREFIX)


class PrefixRouter:
    def __init__(
        self,
        replicas: int,
        block_tokens: int = 16,
        max_prefixes: int = 1 << 16,
        max_imbalance: int = 4,
    ) -> None:
        if replicas < 1 or block_tokens < 1 or max_prefixes < 1 or max_imbalance < 0:
            raise ValueError(
                "a router needs replicas, block_tokens and max_prefixes >= 1 and "
                f"max_imbalance >= 0, got {replicas}, {block_tokens}, {max_prefixes}, "
                f"{max_imbalance}"
            )
        self.replicas = replicas
        self.block_tokens = block_tokens
        self.max_prefixes = max_prefixes
        self.max_imbalance = max_imbalance
        self.load = [0] * replicas
        self.routed: Counter[tuple[int, str]] = Counter()
        self._owners: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica

    def choose(self, prompt: Sequence[Token], down: Collection[int] = ()) -> Route:
        """The replica for a prompt, avoiding the `down` ones while any other is left
        (with every replica down, the least loaded of all: Ray queues the call until
        its actor is back)."""
        live = [r for r in range(self.replicas) if r not in down] or list(range(self.replicas))
        least = min(live, key=lambda r: (self.load[r], r))
        owner, matched = self._longest_owner(prompt)
        if (
            owner is not None
            and owner in live
            and self.load[owner] - self.load[least] <= self.max_imbalance
        ):
            return Route(owner, PREFIX, matched)
        return Route(least, LEAST_LOADED, 0)

    def started(self, route: Route, prompt: Sequence[Token], weight: int) -> None:
        """`weight` generations went to `route.replica`, which now holds the prompt."""
        self.load[route.replica] += weight
        self.routed[route.replica, route.reason] += 1
        for key in self._keys(prompt):
            self._owners[key] = route.replica
            self._owners.move_to_end(key)
        while len(self._owners) > self.max_prefixes:
            self._owners.popitem(last=False)

    def ended(self, replica: int, weight: int) -> None:
        self.load[replica] -= weight

    def forget(self, replica: int) -> None:
        """The replica lost its caches (it restarted): nothing routes to it by prefix."""
        for key in [key for key, owner in self._owners.items() if owner == replica]:
            del self._owners[key]

    def _longest_owner(self, prompt: Sequence[Token]) -> tuple[int | None, int]:
        owner, matched = None, 0
        for blocks, key in enumerate(self._keys(prompt), start=1):
            found = self._owners.get(key)
            if found is None:
                break
            owner, matched = found, blocks * self.block_tokens
        if owner is not None:
            for key in self._keys(prompt[:matched]):
                self._owners.move_to_end(key)
        return owner, matched

    def _keys(self, prompt: Sequence[Token]) -> list[int]:
        """One key per whole block, each standing for the prompt up to that block's end."""
        keys, key = [], 0
        size = self.block_tokens
        for start in range(0, len(prompt) - size + 1, size):
            key = hash((key, tuple(prompt[start : start + size])))
            keys.append(key)
        return keys
