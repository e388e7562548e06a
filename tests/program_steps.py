"""One scenario of packed steps for comparing executors: 8 sessions, prompts of mixed
lengths, and steps of every kind a program maps differently: prompt slices below the
prefill bound run as decode rows, decodes alone (several widths, padded), and mixes of
decodes and prompt chunks on the wide method, one of them cut into two forwards.

`run_scenario(executor, sampling)` drives an initialised executor through it and returns
each session's sampled tokens; executors that compute the same logits give the same
tokens, greedy or seeded. Shapes assumed: max_step_tokens / max_batch_tokens 64 and a
prefill bound of 9 (what `SCENARIO_SHAPE` and the program fixtures use).
"""

from __future__ import annotations

import numpy as np

from cellbatch.executor.cell_executor import ExecutorShape
from cellbatch.generation_config import SamplingParams
from cellbatch.types import BatchInput, Input

MAX_STEP = 64
MIN_PREFILL = 9
DECODE_WIDTHS = (1, 2, 4, 8)
# The executors' limits for the scenario: 8 sessions, steps of MAX_STEP tokens.
SCENARIO_SHAPE = ExecutorShape(
    max_sessions=8, max_session_tokens=128, max_cells=2048, max_batch_tokens=MAX_STEP
)
PROMPT_LENGTHS = (3, 5, 9, 12, 17, 30, 41, 70)
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40)

# Each step: ("prompt", session, offset, size) chunks and ("decode", session) tokens, in
# token-axis order. Comments: what the step plan makes of it (bound 9, step 64).
STEPS: tuple[tuple[tuple, ...], ...] = (
    (("prompt", 0, 0, 3), ("prompt", 1, 0, 5)),  # 8 tokens: prompt slices as decode rows
    (("prompt", 2, 0, 9), ("prompt", 3, 0, 12)),  # 21: prefill
    (("decode", 0), ("decode", 1)),  # decodes alone, width 2
    (*(("decode", s) for s in range(4)), ("prompt", 4, 0, 17)),  # a mix: prefill
    # 65 tokens: prefill over 56, then prefill over the last 9 (plan_slices borrows)
    (*(("decode", s) for s in range(5)), ("prompt", 5, 0, 30), ("prompt", 6, 0, 30)),
    (("prompt", 6, 30, 11), ("prompt", 7, 0, 50)),  # 61: prefill, session 7 not done
    (*(("decode", s) for s in range(7)), ("prompt", 7, 50, 20)),  # 27: prefill
    tuple(("decode", s) for s in range(8)),  # 8 decodes: decode width 8
    (("decode", 0), ("decode", 3), ("decode", 5)),  # 3 decodes: width 4, one padding row
    (("decode", 6),),  # 1 decode: width 1
    (("decode", 7), ("prompt", 0, 0, 2)),  # session 0 replays its last 2 (a rewind) + 1
    *(tuple(("decode", s) for s in range(8)),) * 4,
)


def prompts(vocab: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def run_scenario(executor, vocab: int, sampling: SamplingParams) -> list[list[int]]:
    """Drives `executor` (initialised) through STEPS; each session's sampled tokens."""
    texts = prompts(vocab)
    sids = [executor.open_session() for _ in texts]
    for index, sid in enumerate(sids):
        executor.set_sampling(sid, sampling, 1000 + index)
    history = [list(text) for text in texts]  # what each session has fed or will feed
    sampled: list[list[int]] = [[] for _ in texts]
    fed = [0] * len(texts)  # positions each session holds
    for step in STEPS:
        inputs = []
        for item in step:
            session = item[1]
            if item[0] == "decode":
                token = sampled[session][-1]
                history[session].append(token)
                start = fed[session]
                inputs.append(Input(sids[session], True, 0, 1, (token,), start))
                fed[session] = start + 1
            else:
                _, _, offset, size = item
                if offset == 0 and fed[session] > size:  # a replay of the last `size` tokens
                    offset = fed[session] - size
                payload = tuple(history[session])
                last = offset + size == len(payload)
                inputs.append(Input(sids[session], last, offset, size, payload, 0))
                fed[session] = offset + size
        outputs = executor.execute(BatchInput(tuple(inputs))).outputs
        for item, output in zip(inputs, outputs, strict=True):
            if output is not None:
                sampled[sids.index(item.sid)].append(output.tokens[0])
    return sampled
