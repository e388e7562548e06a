"""A prefix common to all the prompts of one `Engine.generate` call, fed once.

Owns: `feed_shared_prefix` and the root session it returns.
Promises: the root holds exactly the first `length` tokens of every prompt, computed
under the prompts' own LoRA adapter (or none), and each
prompt keeps at least its last token to feed (its logits give the first new token); no
root when the prefix is shorter than MIN_SHARED_PREFIX, when there is one prompt or one
session, or when the engine cannot spare a session or the prefill fails.
Never: submits the prompts; the Engine does, from the root.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cellbatch.runner import Runner, Session
from cellbatch.runner.snapshots import common_prefix_length
from cellbatch.types import FinishReason, Token

# Shorter common prefixes are fed by every prompt: the extra turn would cost more than
# it saves.
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class SharedPrefix:
    session: Session  # idle, holding exactly the first `length` tokens of every prompt
    length: int


def feed_shared_prefix(
    runner: Runner,
    prompts: Sequence[Sequence[Token]],
    max_sessions: int,
    adapter: str | None = None,
) -> SharedPrefix | None:
    """A session fed with the prompts' common prefix under the LoRA adapter the prompts
    run with (None: the base model), or None (see the module)."""
    if len(prompts) < 2 or max_sessions < 2:
        return None  # with one session, the root would only delay the first prompt
    arrays = [np.asarray(prompt, dtype=np.int64) for prompt in prompts]
    common = min(common_prefix_length(arrays[0], other) for other in arrays[1:])
    length = min(common, min(map(len, arrays)) - 1)
    if length < MIN_SHARED_PREFIX:
        return None
    session = runner.open_session_async().result()
    if session is None:
        return None
    handle = session.prefill_async(list(prompts[0][:length]), adapter=adapter)
    handle.wait()
    if handle.finish_reason() != FinishReason.TOKEN_LIMIT:
        session.close()
        return None
    return SharedPrefix(session, length)
