"""A drafter that drafts what a reference run produced next, wrong at every third
draft (so that runs are partly kept, partly rejected), and the decode run that verifies
its drafts: for tests that an executor's verification keeps one-at-a-time tokens."""

from __future__ import annotations

from cellbatch.executor.cell_executor import CellExecutor
from cellbatch.generation_config import SamplingParams
from cellbatch.types import BatchInput, Input
from program_steps import SEEDED


class ScriptedDrafter:
    """Drafts what a reference run produced next, wrong at every third draft."""

    method = "scripted"

    def __init__(self, futures: dict[int, list[int]]) -> None:
        self.futures = futures  # session -> its whole context, as the reference ran it
        self.proposed = 0

    def initialize(self) -> None:
        return

    def propose(self, requests):  # type: ignore[no-untyped-def]
        drafts = []
        for request in requests:
            known = self.futures[request.sid][len(request.context) : len(request.context) + 3]
            # Wrong wherever its position is a multiple of 3: never three kept in a row.
            start = len(request.context)
            draft = [t if (start + i) % 3 else (t + 1) % 64 for i, t in enumerate(known)]
            self.proposed += len(draft)
            drafts.append(tuple(draft[: request.limit]))
        return drafts

    def forget(self, sid: int, length: int) -> None:
        return

    def accepted(self, sid: int, length: int) -> None:
        return

    def clone(self, source: int, clone: int, upto: int) -> None:
        return

    def close(self, sid: int) -> None:
        return


def decode_run(
    executor: CellExecutor,
    prompts: list[list[int]],
    steps: int,
    drafts: int,
    sampling: SamplingParams = SEEDED,
) -> list[list[int]]:
    """Each session's context after its prompt and `steps` decode steps (each verifying
    up to `drafts` drafts), sampled with `sampling` (seeded per session)."""
    sids = [executor.open_session() for _ in prompts]
    for index, sid in enumerate(sids):
        executor.set_sampling(sid, sampling, 50 + index)
    contexts = [list(prompt) for prompt in prompts]
    batch = BatchInput(
        tuple(
            Input(sid, True, 0, len(p), tuple(p), 0) for sid, p in zip(sids, prompts, strict=True)
        )
    )
    for _ in range(steps):
        outputs = executor.execute(batch).outputs
        inputs = []
        for sid, context, output in zip(sids, contexts, outputs, strict=True):
            context.extend(output.tokens)
            position = len(context) - 1
            inputs.append(Input(sid, True, 0, 1, (context[-1],), position, max_drafts=drafts))
        batch = BatchInput(tuple(inputs))
    return contexts
