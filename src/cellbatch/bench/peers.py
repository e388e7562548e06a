"""The throughput benchmark's peers: transformers (one prompt at a time, a left-padded
batch, continuous batching `generate_batch`) and cellbatch (`Engine.generate`, with and
without the shared prompt prefix; sessions decoding in lockstep), each behind one
`generate(prompts, max_new_tokens)` call that `time_peer` times.

Owns: loading the transformers model; each peer's greedy generation; the warm-up and
timing of a peer; cellbatch's engine counters over a call; probing the reference model
where two peers' tokens part.
Promises: every peer decodes greedily, stops at the given stop tokens (kept in its
output, as cellbatch keeps them) and returns tokens per prompt, in prompt order; a peer
that raises comes back as a `PeerRun` with its error, not as an exception. cellbatch is
driven only through the public `Engine`/`Session` API.
Never: prints anything but progress lines on stderr; changes the engine's limits.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from cellbatch.bench.report import Agreement, ConcurrencyPoint, EngineWindow, PeerRun
from cellbatch.bench.workload import (
    CELLBATCH,
    CELLBATCH_UNSHARED,
    CONTINUOUS,
    PADDED,
    PADDED_FP32,
    SINGLE,
    WARMUP_TOKENS,
)
from cellbatch.generation_config import GenConfig
from cellbatch.types import FinishReason, Token

# Tokens per page of transformers' paged cache in `generate_batch`.
CONTINUOUS_PAGE_SIZE = 32

GenerateFn = Callable[[Sequence[Sequence[Token]], int], list[list[Token]]]

# A transformers causal LM (untyped: transformers ships no type information for it).
HFModel = Any


def progress(message: str) -> None:
    print(f"cellbatch bench: {message}", file=sys.stderr, flush=True)


def until_stop(tokens: Sequence[Token], stop_tokens: frozenset[Token]) -> list[Token]:
    """`tokens` through the first stop token (kept, as cellbatch keeps it); all if none."""
    for index, token in enumerate(tokens):
        if token in stop_tokens:
            return [int(t) for t in tokens[: index + 1]]
    return [int(t) for t in tokens]


def load_transformers_model(path: Path, dtype: torch.dtype) -> HFModel:
    """The same checkpoint through transformers (a GGUF is dequantised as cellbatch does)."""
    from transformers import AutoModelForCausalLM

    from cellbatch.model.loading import locate_model

    files = locate_model(path)
    extra = {"gguf_file": files.path.name} if files.kind == "gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(files.folder), dtype=dtype, attn_implementation="sdpa", **extra
    )
    return model.eval()  # type: ignore[no-untyped-call]  # transformers: untyped


def _device(model: HFModel) -> torch.device:
    """Where a transformers model's weights are (the CPU for a module without them)."""
    return torch.device(getattr(model, "device", "cpu"))


def greedy_config(max_new_tokens: int, stop_tokens: frozenset[Token], pad: Token) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(  # type: ignore[no-untyped-call]  # transformers: untyped
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=sorted(stop_tokens),
        pad_token_id=pad,
    )


def left_padded(
    prompts: Sequence[Sequence[Token]], pad: Token
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), both [prompts, longest], prompts flush right."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def transformers_single(
    model: HFModel, prompts: Sequence[Sequence[Token]], config: Any, stop: frozenset[Token]
) -> list[list[Token]]:
    """Each prompt alone, batch 1, no padding: the reference greedy tokens."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], dtype=torch.long, device=_device(model))
            generated = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            outputs.append(until_stop(generated[0, len(prompt) :].tolist(), stop))
    return outputs


def transformers_padded(
    model: HFModel, prompts: Sequence[Sequence[Token]], config: Any, stop: frozenset[Token]
) -> list[list[Token]]:
    """All prompts as one left-padded batch."""
    ids, mask = left_padded(prompts, config.pad_token_id)
    ids, mask = ids.to(_device(model)), mask.to(_device(model))
    with torch.inference_mode():
        generated = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return [until_stop(row, stop) for row in generated[:, ids.shape[1] :].tolist()]


def transformers_continuous(
    model: HFModel,
    prompts: Sequence[Sequence[Token]],
    config: Any,
    stop: frozenset[Token],
    max_batch_tokens: int,
) -> list[list[Token]]:
    """transformers' continuous batching, its paged cache sized by hand: by default it
    sizes itself from free accelerator memory, which a CPU does not report."""
    from transformers import ContinuousBatchingConfig

    pages = sum(
        math.ceil((len(prompt) + config.max_new_tokens) / CONTINUOUS_PAGE_SIZE)
        for prompt in prompts
    )
    batching = ContinuousBatchingConfig(
        page_size=CONTINUOUS_PAGE_SIZE,
        num_blocks=pages + len(prompts),  # one spare page per request
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=len(prompts),
    )
    with torch.inference_mode():
        results = list(
            model.generate_batch(
                [list(prompt) for prompt in prompts],
                generation_config=config,
                continuous_batching_config=batching,
            ).values()
        )
    if len(results) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(results)} of {len(prompts)} results")
    for prompt, result in zip(prompts, results, strict=True):
        if result.error is not None or list(result.prompt_ids) != list(prompt):
            raise RuntimeError(f"generate_batch request {result.request_id} failed: {result.error}")
    return [until_stop(result.generated_tokens, stop) for result in results]


def cellbatch_generate(
    engine: Any, prompts: Sequence[Sequence[Token]], config: GenConfig, share_prefix: bool = True
) -> tuple[list[list[Token]], EngineWindow]:
    """All prompts through `Engine.generate`, and the engine's counters over that call."""
    before = engine.metrics()
    started = perf_counter()
    results = engine.generate(prompts, config, share_prefix=share_prefix)
    window = EngineWindow.between(before, engine.metrics(), started)
    failed = [
        f"prompt {i}: {r.finish_reason}: {r.error}" for i, r in enumerate(results) if not r.ok
    ]
    if failed:
        raise RuntimeError("; ".join(failed))
    return [list(result.tokens) for result in results], window


def decode_sweep_point(
    engine: Any, prompts: Sequence[Sequence[Token]], sessions: int, new_tokens: int
) -> ConcurrencyPoint:
    """`sessions` generations decoding in lockstep (prompts reused round-robin).

    Turn 1 prefills every prompt and takes one token; turn 2 feeds one more token and
    generates `new_tokens` without stop tokens, so after its first step every step
    decodes all the sessions at once. Only turn 2 is measured.
    """
    opened = [engine.open_session() for _ in range(sessions)]
    contexts = [prompts[index % len(prompts)] for index in range(sessions)]
    none: frozenset[Token] = frozenset()  # GenConfig's None would mean the model's own
    try:
        _wait_all(
            [
                session.generate_async(list(context), GenConfig(max_new_tokens=1, stop_tokens=none))
                for session, context in zip(opened, contexts, strict=True)
            ],
            FinishReason.TOKEN_LIMIT,
        )
        before = engine.metrics()
        started = perf_counter()
        _wait_all(
            [
                session.generate_async(
                    [context[-1]], GenConfig(max_new_tokens=new_tokens, stop_tokens=none)
                )
                for session, context in zip(opened, contexts, strict=True)
            ],
            FinishReason.TOKEN_LIMIT,
        )
        window = EngineWindow.between(before, engine.metrics(), started)
    finally:
        for session in opened:
            session.close()
    return ConcurrencyPoint(sessions, window)


def _wait_all(handles: Sequence[Any], expected: FinishReason) -> None:
    for handle in handles:
        handle.wait()
    wrong = [
        f"{handle.finish_reason()}: {handle.error()}"
        for handle in handles
        if handle.finish_reason() != expected
    ]
    if wrong:
        raise RuntimeError(f"{len(wrong)} generations did not end by {expected}: {wrong[0]}")


def probe_divergences(
    model: HFModel,
    prompts: Sequence[Sequence[Token]],
    reference: Sequence[Sequence[Token]],
    agreement: Agreement,
) -> None:
    """Fills each divergence's top-2 logit gap, from the reference model's logits after
    the prompt and the reference tokens before the divergence."""
    with torch.inference_mode():
        for divergence in agreement.divergences:
            context = list(prompts[divergence.prompt]) + list(
                reference[divergence.prompt][: divergence.index]
            )
            ids = torch.tensor([context], dtype=torch.long, device=_device(model))
            logits = model(ids).logits[0, -1].float()
            top = torch.topk(logits, 2)
            divergence.top2_gap = float(top.values[0] - top.values[1])
            divergence.ours_in_top2 = divergence.ours in top.indices.tolist()


@dataclass(frozen=True)
class Peer:
    """Something to time: `generate(prompts, max_new_tokens)` -> tokens per prompt.
    A peer in another process times itself (`own_seconds`: its latest call's generation,
    without the process start and the model load) and warms itself up."""

    name: str
    label: str
    concurrency: int  # generations in flight at once
    dtype: str
    generate: GenerateFn
    own_seconds: Callable[[], float] | None = None


def time_peer(peer: Peer, prompts: Sequence[Sequence[Token]], max_new_tokens: int) -> PeerRun:
    """Warms the peer up on every prompt (a few tokens each, so that every shape the timed
    call meets was met before: oneDNN and AOT kernels are built per shape on first use),
    then times it on all of them."""
    run = PeerRun(peer.name, peer.label, peer.concurrency, peer.dtype)
    progress(f"{peer.label}: {len(prompts)} prompts, at most {max_new_tokens} new tokens each")
    try:
        if peer.own_seconds is None:
            peer.generate(prompts, WARMUP_TOKENS)
        started = perf_counter()
        run.outputs = peer.generate(prompts, max_new_tokens)
        run.seconds = perf_counter() - started if peer.own_seconds is None else peer.own_seconds()
    except Exception as error:  # a failing peer is reported, and the others still run
        run.error = f"{type(error).__name__}: {error}"
        progress(f"{peer.label}: failed: {run.error}")
        return run
    progress(f"{peer.label}: {run.generated_tokens} tokens in {run.seconds:.2f} s")
    return run


def transformers_peer(
    name: str,
    model: HFModel,
    count: int,
    stop: frozenset[Token],
    pad: Token,
    max_batch_tokens: int,
) -> Peer:
    """One of the transformers peers over `count` prompts, with `model` in its dtype."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    kinds: dict[str, tuple[str, int, Callable[..., list[list[Token]]]]] = {
        SINGLE: ("transformers one prompt at a time", 1, transformers_single),
        PADDED: (f"transformers padded batch of {count}", count, transformers_padded),
        PADDED_FP32: (
            f"transformers padded batch of {count} in float32",
            count,
            transformers_padded,
        ),
        CONTINUOUS: (
            "transformers generate_batch",
            count,
            functools.partial(transformers_continuous, max_batch_tokens=max_batch_tokens),
        ),
    }
    label, concurrency, generate = kinds[name]
    return Peer(
        name,
        label,
        concurrency,
        dtype,
        lambda prompts, new: generate(model, prompts, greedy_config(new, stop, pad), stop),
    )


def cellbatch_peer(
    engine: Any,
    count: int,
    dtype: str,
    stop: frozenset[Token],
    share_prefix: bool = True,
    quantize: str = "none",
    activations: str = "auto",
) -> tuple[Peer, list[EngineWindow]]:
    """cellbatch over `count` prompts, and the list that holds the engine's counters over
    its latest call; its label names `quantize` (float weights, the bench's default, are
    not the engine's: say so), and `activations` unless "auto"."""
    windows: list[EngineWindow] = []

    def generate(prompts: Sequence[Sequence[Token]], new: int) -> list[list[Token]]:
        config = GenConfig(max_new_tokens=new, stop_tokens=stop)
        outputs, window = cellbatch_generate(engine, prompts, config, share_prefix)
        windows[:] = [window]
        return outputs

    weights = (
        ", float weights (--quantize none)" if quantize == "none" else f", --quantize {quantize}"
    )
    weights += "" if activations == "auto" else f", --activations {activations}"
    if share_prefix:
        return Peer(CELLBATCH, f"cellbatch{weights}", count, dtype, generate), windows
    label = f"cellbatch, prompt prefix not shared{weights}"
    return Peer(CELLBATCH_UNSHARED, label, count, dtype, generate), windows
