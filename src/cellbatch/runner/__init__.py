"""The runner: one engine thread drives sessions, a scheduler and an executor
(docs/design.md#runner-sessions-and-handles).

Modules, each with one job (imports only go down this list):
- `metrics_ledger`: the events the books below record and the one owner of the engine's
  live counters;
- `commands`: the typed commands and the `Inbox` the faces post them to;
- `handle`: `GenerationHandle`, a caller's view of one generation (threads, asyncio);
- `generation`: engine-side session records and generation state, and how a generation
  stops;
- `session`: `Session`, a caller's face for one conversation;
- `admission`: the waiting queue and running set, the policy's arithmetic (what a
  generation needs, whether it fits, which one gives way first), and the occupancy
  (running, waiting) the loop publishes;
- `batch`: the check of an executor's answer to a batch;
- `sessions`, `tasks`: the engine thread's books of sessions (and snapshots) and of
  tasks (ids, owners, a turn's feed cut into prompt chunks);
- `step_planner`: `StepPlanner`, the one owner of what runs next: admission, the
  step's tasks, the cells they take and who gives cells up;
- `loop`: `EngineLoop`, what the engine thread does: commands, then the planner's
  step through the executor, then the tokens delivered;
- `runner`: `Runner`, the face that starts the engine thread and posts to its inbox.
"""

from cellbatch.runner.admission import AdmissionPolicy, Occupancy
from cellbatch.runner.generation import SettledCallback, UpdateCallback
from cellbatch.runner.handle import GenerationHandle
from cellbatch.runner.loop import InitializationState
from cellbatch.runner.runner import Runner
from cellbatch.runner.session import Session

__all__ = [
    "AdmissionPolicy",
    "GenerationHandle",
    "InitializationState",
    "Occupancy",
    "Runner",
    "Session",
    "SettledCallback",
    "UpdateCallback",
]
