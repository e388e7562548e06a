"""What an executor's answer to a batch must look like before the runner trusts it.

Owns: `check_outputs`, the one validation of a `BatchOutput` against its inputs.
Promises: returns the outputs when each `outputs[i]` answers `inputs[i]` (an Output
of the same session holding tokens, or a pooling session's embedding, where output was
asked, None where not, no more verified drafts than the input allowed and at most one
token beyond them, its logprobs, when it has any, one per token); raises
`BatchFailure` naming the first problem otherwise.
Never: looks at token values or keeps state.
"""

from __future__ import annotations

from collections.abc import Sequence

from cellbatch.types import BatchOutput, Input, Output


class BatchFailure(Exception):
    """The whole batch failed; the message says why."""


def check_outputs(inputs: Sequence[Input], result: BatchOutput | None) -> Sequence[Output | None]:
    if result is None:
        raise BatchFailure("executor.execute returned None")
    outputs = getattr(result, "outputs", None)
    if not isinstance(outputs, (tuple, list)):
        raise BatchFailure(f"executor.execute returned {type(result).__name__}, not a BatchOutput")
    if len(outputs) != len(inputs):
        raise BatchFailure(f"the executor returned {len(outputs)} outputs for {len(inputs)} inputs")
    for i, (inp, out) in enumerate(zip(inputs, outputs, strict=True)):
        if out is None:
            if inp.produce_output:
                raise BatchFailure(
                    f"no output for input {i} (session {inp.sid}), which asked for one"
                )
        elif not isinstance(out, Output):
            raise BatchFailure(f"output {i} is a {type(out).__name__}, not an Output")
        elif not inp.produce_output:
            raise BatchFailure(f"an output for input {i} (session {inp.sid}), which asked for none")
        elif out.sid != inp.sid:
            raise BatchFailure(
                f"output {i} names session {out.sid}, but input {i} is session {inp.sid}"
            )
        elif not out.tokens and out.embedding is None:
            raise BatchFailure(f"output {i} (session {inp.sid}) holds no tokens")
        elif out.drafted and (out.drafted > inp.max_drafts or len(out.tokens) > out.drafted + 1):
            raise BatchFailure(
                f"output {i} (session {inp.sid}) verified {out.drafted} drafts and returned "
                f"{len(out.tokens)} tokens, but the input allowed {inp.max_drafts} drafts; a "
                "verification returns at most its drafts and one more token"
            )
        elif out.logprobs and len(out.logprobs) != len(out.tokens):
            raise BatchFailure(
                f"output {i} (session {inp.sid}) holds {len(out.tokens)} tokens but "
                f"{len(out.logprobs)} logprobs; give one per token, or none"
            )
    return outputs
