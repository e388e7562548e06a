"""The checks of one call's prompts and configs, before anything is submitted.

Owns: `call_config` (a call's GenConfig from its params and keyword options), `seeded`
(each prompt's own seed) and `prompt_problem` (why a prompt cannot run).
Promises: a seeded call gives each prompt the seed `seed + index`, so that a seeded
result does not depend on what else shares the batch; a prompt's problem names the
numbers and the fix, checked in order: emptiness, the call's constraint, the
vocabulary, the session limit (a bad max_new_tokens is the runner's to refuse).
Never: touches the engine, the runner or a tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.types import InvalidArgumentError, Token


def call_config(
    params: GenConfig | SamplingParams | None,
    max_new_tokens: int | None,
    seed: int | None,
    stop: Sequence[str],
) -> GenConfig:
    """The call's GenConfig: `params` (a GenConfig, a SamplingParams or None for the
    defaults) with the keyword options laid over it."""
    if isinstance(params, GenConfig):
        config = params
    elif isinstance(params, SamplingParams):
        config = GenConfig(sampling=params)
    elif params is None:
        config = GenConfig()
    else:
        raise InvalidArgumentError(
            f"params must be a GenConfig or SamplingParams, got {type(params).__name__}"
        )
    if max_new_tokens is not None:
        config = replace(config, max_new_tokens=max_new_tokens)
    if seed is not None:
        config = replace(config, seed=seed)
    if isinstance(stop, str):
        stop = (stop,)
    return replace(config, stop_strings=(*config.stop_strings, *stop))


def seeded(config: GenConfig, index: int) -> GenConfig:
    """Prompt `index`'s own seed, so a seeded run does not depend on batching."""
    if config.seed is None:
        return config
    return replace(config, seed=(config.seed + index) % 2**63)


def prompt_problem(
    tokens: Sequence[Token],
    config: GenConfig,
    unconstrainable: str,
    vocab_size: int,
    max_session_tokens: int,
) -> str:
    """Why the prompt cannot run on a model of `vocab_size` tokens in sessions of
    `max_session_tokens`, or "" (`unconstrainable`: why the call's constraint cannot
    run, or "")."""
    if not tokens:
        return "the prompt is empty: a generation must feed at least one token"
    if unconstrainable:
        return unconstrainable
    for index, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            return (
                f"token id {token} at index {index} is outside the vocabulary "
                f"[0, {vocab_size}); use ids of this model's tokenizer"
            )
    needed = len(tokens) + config.max_new_tokens
    if needed > max_session_tokens:
        return (
            f"the prompt has {len(tokens)} tokens and asks for {config.max_new_tokens} new "
            f"ones ({needed} in all), above the session limit of {max_session_tokens} tokens; "
            "shorten the prompt, lower max_new_tokens or raise max_session_tokens"
        )
    return ""
