"""Engine against real models: token parity with transformers, batch invariance, multi-turn
sessions, clones and KV cell accounting (BEHAVIOURS "Model executor").

Everything is greedy and fp32, so tokens must match exactly. Tiny random checkpoints
are built once per module; the slow tests use the embedded default model.
"""

from __future__ import annotations

import functools
import random
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from cellbatch.engine import Engine, EngineShape, ModuleBackend
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.model.loading import load_model
from cellbatch.types import FinishReason
from tiny_models import (
    KINDS,
    first_divergence,
    greedy_check,
    greedy_reference,
    make_tiny_checkpoint,
    near_tie,
    reference_model,
)

NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 7, 12, 19, 26, 35, 47, 60)
MISTRAL_WINDOW = 12  # shorter than most prompts: the window is exercised in prefill and decode
VOCAB = 96
WAIT_S = 10.0
# eos/bos off: every generation runs its full budget, so each compares 32 tokens.
NO_EOS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}


def random_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tiny models run many small ops: on a shared 2-core machine a second intra-op thread
    makes transformers' reference about 20x slower and buys nothing. The default model
    (slow tests) keeps every thread."""
    before = torch.get_num_threads()
    if request.node.get_closest_marker("slow") is None:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_folder(kind) -> the saved folder of a tiny random `kind` model (built once)."""
    root = tmp_path_factory.mktemp("tiny")

    @functools.cache
    def build(kind: str) -> Path:
        overrides = {"sliding_window": MISTRAL_WINDOW} if kind == "mistral" else {}
        return make_tiny_checkpoint(kind, root / kind, **NO_EOS, **overrides)[1]

    return build


@pytest.fixture(scope="module")
def llama(tiny_folder: Callable[[str], Path]) -> tuple[object, torch.nn.Module]:
    """(config, module) of the tiny Llama, loaded once and shared by several Engines."""
    return load_model(tiny_folder("llama"), "float32")


@pytest.fixture
def make_engine(llama) -> Iterator[Callable[..., Engine]]:
    """make_engine(**shape) -> an Engine over the shared tiny Llama; closed after the test."""
    engines: list[Engine] = []

    def make(**shape: object) -> Engine:
        config, module = llama
        engines.append(Engine(ModuleBackend(module, config), None, shape=EngineShape(**shape)))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def generate(engine: Engine, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens per prompt; each generation must end normally (stop token or budget)."""
    results = engine.generate(prompts, GenConfig(max_new_tokens=new_tokens))
    for result in results:
        assert result.ok, result.error
    return [result.tokens for result in results]


def run_turn(session, delta: Sequence[int], new_tokens: int) -> list[int]:
    handle = session.generate_async(list(delta), GenConfig(max_new_tokens=new_tokens))
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.TOKEN_LIMIT, handle.error()
    return handle.tokens()


# -- parity with transformers -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers(tiny_folder, kind: str) -> None:
    folder = tiny_folder(kind)
    prompts = random_prompts(PROMPT_LENGTHS, seed=KINDS.index(kind))
    with Engine.from_pretrained(folder, dtype="float32", max_sessions=8) as engine:
        assert engine.stop_tokens == frozenset()
        results = engine.generate(prompts, GenConfig(max_new_tokens=NEW_TOKENS))
        # All eight ran side by side, so parity covers shared steps, not lone runs.
        assert engine.metrics().peak_concurrent_generations == len(prompts)
    reference = reference_model(folder)
    if kind == "mistral":
        assert reference.config.sliding_window == MISTRAL_WINDOW < max(PROMPT_LENGTHS)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.finish_reason == FinishReason.TOKEN_LIMIT, result.error
        assert len(result.tokens) == NEW_TOKENS
        expected = greedy_reference(reference, prompt, NEW_TOKENS)
        assert result.tokens == expected.tokens, (
            f"{kind}, prompt of {len(prompt)} tokens: {first_divergence(result.tokens, expected)}"
        )


# -- batch invariance ---------------------------------------------------------------------

TARGET_LENGTH = 150  # several chunks at sizes 16 and 64, one at 256
INVARIANCE_TOKENS = 24


@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_a_prompt_gives_the_same_tokens_whatever_shares_its_batch(make_engine, chunk) -> None:
    target = random_prompts([TARGET_LENGTH], seed=100)[0]
    others = random_prompts([5 + 7 * i for i in range(31)], seed=101)
    alone = generate(make_engine(), [target], INVARIANCE_TOKENS)[0]

    # A full chunk must fit beside 32 decodes (the scheduler refuses less).
    engine = make_engine(max_sessions=32, max_prefill_chunk=chunk, max_batch_tokens=chunk + 32)
    assert generate(engine, [target], INVARIANCE_TOKENS)[0] == alone
    first = generate(engine, [target, *others], INVARIANCE_TOKENS)
    assert engine.metrics().peak_concurrent_generations == 32
    assert first[0] == alone
    last = generate(engine, [*others, target], INVARIANCE_TOKENS)
    assert last[-1] == alone
    # The others are batch-invariant too, whichever slot they had.
    assert first[1:] == last[:-1]


def test_an_int8_cache_keeps_a_prompts_tokens_whatever_shares_its_batch(tiny_folder) -> None:
    """`kv_dtype="int8"`: the pool holds codes and a scale per head (about half bf16's bytes,
    a quarter of fp32's here), the report says so, and a prompt's tokens stay its own."""
    target = random_prompts([TARGET_LENGTH], seed=100)[0]
    others = random_prompts([5 + 7 * i for i in range(15)], seed=101)
    shape = {"max_sessions": 16, "max_prefill_chunk": 16, "max_batch_tokens": 48}
    with Engine.from_pretrained(
        tiny_folder("llama"), dtype="float32", kv_dtype="int8", **shape
    ) as engine:
        assert engine.kv_dtype == torch.int8
        geometry = engine.geometry
        alone = generate(engine, [target], INVARIANCE_TOKENS)[0]
        assert generate(engine, [*others, target], INVARIANCE_TOKENS)[-1] == alone
        usage = engine.kv_usage()
        assert usage.bytes_per_cell == 2 * geometry.num_layers * geometry.num_kv_heads * (
            geometry.head_dim + 4
        )


# -- sessions: turns and clones -----------------------------------------------------------


def test_two_turns_give_the_tokens_of_one_prompt_holding_both(make_engine) -> None:
    first_prompt, delta = random_prompts([20, 9], seed=7)
    engine = make_engine()
    with engine.open_session() as session:
        first = run_turn(session, first_prompt, 10)
        # The last generated token is pending: produced, not yet fed to the model.
        assert session.position() == len(first_prompt) + len(first) - 1
        assert session.unfed() == (first[-1],)
        second = run_turn(session, delta, 12)
    whole = first_prompt + first + delta
    assert generate(engine, [whole], 12)[0] == second
    assert generate(engine, [first_prompt], 10)[0] == first


def test_a_clone_continues_exactly_as_its_source_would(make_engine) -> None:
    prompt, delta = random_prompts([30, 6], seed=8)
    engine = make_engine()
    expected_first = generate(engine, [prompt], 8)[0]
    expected_next = generate(engine, [prompt + expected_first + delta], 10)[0]

    with engine.open_session() as source:
        assert run_turn(source, prompt, 8) == expected_first
        at_end = source.clone_async(source.position()).result(WAIT_S)
        mid_prompt = source.clone_async(12).result(WAIT_S)
        assert at_end is not None and mid_prompt is not None
        assert at_end.position() == source.position() and mid_prompt.position() == 12
        # A clone holds only committed tokens: the source's pending token comes first.
        assert run_turn(at_end, [*source.unfed(), *delta], 10) == expected_next
        # A clone inside the prompt, fed the rest of it, regenerates the first turn.
        assert run_turn(mid_prompt, prompt[12:], 8) == expected_first
        # The clones wrote their own cells: the source continues undisturbed.
        assert run_turn(source, delta, 10) == expected_next
        at_end.close()
        mid_prompt.close()


# -- KV cells ----------------------------------------------------------------------------


def test_no_cell_is_in_use_once_every_session_has_closed(make_engine) -> None:
    engine = make_engine()
    generate(engine, random_prompts(PROMPT_LENGTHS, seed=3), 16)
    with engine.open_session() as session:
        run_turn(session, random_prompts([40], seed=4)[0], 8)
        clone = session.clone_async(20).result(WAIT_S)
        assert clone is not None
        assert engine.executor.cache.used_cells() == 40 + 8 - 1
        clone.close()
    assert wait_until(lambda: engine.executor.cache.used_cells() == 0)
    assert engine.kv_usage().cells_in_use == 0


def test_generate_returns_once_its_sessions_cells_are_back(make_engine) -> None:
    engine = make_engine()
    for round_ in range(5):
        generate(engine, random_prompts(PROMPT_LENGTHS, seed=20 + round_), 8)
        # At once: no wait_until. Before, it could read hundreds of cells for ~50 ms.
        assert engine.kv_usage().cells_in_use == 0
        assert engine.executor.cache.used_cells() == 0


def test_cells_are_reused_across_rounds(make_engine) -> None:
    engine = make_engine()
    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    marks = []
    for _ in range(3):
        generate(engine, prompts, 16)
        assert wait_until(lambda: engine.kv_usage().cells_in_use == 0)
        usage = engine.kv_usage()
        high_water = engine.executor.cache.high_water()
        marks.append((high_water, usage.pool_rows, usage.growth_count))
    # At most every token of one round at once; later rounds take the freed cells again.
    assert marks[0][0] <= sum(PROMPT_LENGTHS) + 16 * len(PROMPT_LENGTHS) + 1
    assert marks[0] == marks[1] == marks[2]


# -- seeded sampling through the Engine -------------------------------------------------


def test_a_seeded_prompt_samples_the_same_tokens_beside_others(make_engine) -> None:
    prompts = random_prompts([25, 13, 40, 8], seed=9)
    params = GenConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0), seed=1234)
    engine = make_engine()
    alone = engine.generate(prompts[:1], params)[0].tokens
    together = engine.generate(prompts, params)
    assert together[0].tokens == alone
    assert engine.generate(prompts[:1], params)[0].tokens == alone
    # Not greedy in disguise: another seed draws other tokens.
    other_seed = GenConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0), seed=99)
    assert engine.generate(prompts[:1], other_seed)[0].tokens != alone


# -- a prefix shared by every prompt of a call ---------------------------------------------


def prompts_with_a_common_prefix(prefix_length: int, suffix_lengths: Sequence[int]) -> list:
    prefix = random_prompts([prefix_length], seed=21)[0]
    return [prefix + suffix for suffix in random_prompts(suffix_lengths, seed=22)]


@pytest.mark.parametrize("max_sessions", [64, 5, 2, 1])
def test_a_common_prefix_is_fed_once_and_changes_no_token(make_engine, max_sessions) -> None:
    from cellbatch.engine import MIN_SHARED_PREFIX

    prompts = prompts_with_a_common_prefix(MIN_SHARED_PREFIX + 4, [1, 9, 3, 14, 6, 2])
    engine = make_engine(max_sessions=max_sessions)
    params = GenConfig(max_new_tokens=12)
    separate = engine.generate(prompts, params, share_prefix=False)
    before = engine.metrics()
    shared = engine.generate(prompts, params)
    after = engine.metrics()
    assert [r.tokens for r in shared] == [r.tokens for r in separate]
    assert all(r.finish_reason == FinishReason.TOKEN_LIMIT for r in shared)
    assert [r.shared_prefix_tokens for r in separate] == [0] * len(prompts)
    assert after.generations_completed - before.generations_completed == len(prompts)
    # With a single session the prompts run one after another: nothing to share.
    reused = MIN_SHARED_PREFIX + 4 if max_sessions > 1 else 0
    assert [r.shared_prefix_tokens for r in shared] == [reused] * len(prompts)
    assert after.prefill_turns - before.prefill_turns == (1 if reused else 0)
    fed = sum(map(len, prompts)) - (len(prompts) - 1) * reused
    assert after.prefill_tokens - before.prefill_tokens == fed
    assert wait_until(lambda: engine.kv_usage().cells_in_use == 0)


def test_seeded_sampling_draws_the_same_tokens_with_a_shared_prefix(make_engine) -> None:
    from cellbatch.engine import MIN_SHARED_PREFIX

    prompts = prompts_with_a_common_prefix(MIN_SHARED_PREFIX, [3, 8, 1])
    params = GenConfig(max_new_tokens=10, sampling=SamplingParams(temperature=1.0), seed=7)
    engine = make_engine()
    shared = engine.generate(prompts, params)
    assert [r.shared_prefix_tokens for r in shared] == [MIN_SHARED_PREFIX] * 3
    separate = engine.generate(prompts, params, share_prefix=False)
    assert [r.tokens for r in shared] == [r.tokens for r in separate]


def test_a_failing_prompt_does_not_stop_the_others_sharing_a_prefix(make_engine) -> None:
    from cellbatch.engine import MIN_SHARED_PREFIX

    good = prompts_with_a_common_prefix(MIN_SHARED_PREFIX + 2, [4, 6])
    engine = make_engine()
    results = engine.generate([good[0], [], [VOCAB + 5], good[1]], GenConfig(max_new_tokens=5))
    assert [r.ok for r in results] == [True, False, False, True]
    assert [results[0].shared_prefix_tokens, results[3].shared_prefix_tokens] == [
        MIN_SHARED_PREFIX + 2
    ] * 2
    alone = engine.generate(good, GenConfig(max_new_tokens=5), share_prefix=False)
    assert [results[0].tokens, results[3].tokens] == [r.tokens for r in alone]


def test_every_prompt_keeps_its_last_token_to_feed(make_engine) -> None:
    from cellbatch.engine import MIN_SHARED_PREFIX

    prompt = random_prompts([MIN_SHARED_PREFIX + 10], seed=5)[0]
    prompts = [prompt, prompt[:-3], prompt]  # one prompt is a prefix of the others
    engine = make_engine()
    results = engine.generate(prompts, GenConfig(max_new_tokens=6))
    assert [r.shared_prefix_tokens for r in results] == [len(prompt) - 4] * 3
    alone = [engine.generate([p], GenConfig(max_new_tokens=6))[0].tokens for p in prompts]
    assert [r.tokens for r in results] == alone


def test_a_short_common_prefix_is_not_shared(make_engine) -> None:
    from cellbatch.engine import MIN_SHARED_PREFIX

    prompts = prompts_with_a_common_prefix(MIN_SHARED_PREFIX - 1, [4, 7])
    engine = make_engine()
    results = engine.generate(prompts, GenConfig(max_new_tokens=4))
    assert [r.shared_prefix_tokens for r in results] == [0, 0]
    assert engine.metrics().prefill_turns == 0


# -- slow: the embedded default model --------------------------------------------------

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 multiplied by 23?",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Write a Python function that reverses a string.",
    "Who wrote 'Pride and Prejudice'?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between a cat and a dog as pets?",
    "Suggest a name for a small coffee shop by the river.",
    "How many continents are there? Name them.",
    "Describe the water cycle step by step.",
    "Hi!",
]
DEFAULT_NEW_TOKENS = 48


def test_prompts_failing_at_once_free_their_sessions_for_the_rest(make_engine) -> None:
    engine = make_engine(max_sessions=1)
    results = engine.generate([[], [], [], [5, 6, 7]], GenConfig(max_new_tokens=2))
    assert [r.finish_reason for r in results] == [FinishReason.FAILED] * 3 + [
        FinishReason.TOKEN_LIMIT
    ]
    assert all("the prompt is empty" in r.error for r in results[:3])
    assert len(results[3].tokens) == 2


@pytest.fixture(scope="module")
def default_engine() -> Iterator[Engine]:
    # Float weights, as transformers has them (the default keeps the file's int4 class).
    with Engine.from_pretrained(dtype="float32", quantize="none", max_sessions=32) as engine:
        yield engine


@pytest.mark.slow
def test_default_model_matches_transformers(default_engine: Engine, default_reference) -> None:
    engine = default_engine
    prompts = [engine.chat_tokens(text) for text in CHAT_PROMPTS]
    results = engine.generate(prompts, GenConfig(max_new_tokens=DEFAULT_NEW_TOKENS))
    reference = default_reference
    stops = sorted(engine.stop_tokens)
    mismatches = []
    for text, prompt, result in zip(CHAT_PROMPTS, prompts, results, strict=True):
        assert result.ok, result.error
        expected = greedy_check(reference, prompt, result.tokens, DEFAULT_NEW_TOKENS, stops)
        if result.tokens != expected.tokens:
            mismatches.append((text, result.tokens, expected))
    report = "; ".join(f"{t!r}: {first_divergence(ours, e)}" for t, ours, e in mismatches)
    # At most one prompt may part ways, and only at a near-tie in transformers' logits.
    assert len(mismatches) <= 1, report
    for _, ours, expected in mismatches:
        assert near_tie(ours, expected), report
    if mismatches:
        warnings.warn(f"default model, tolerated near-tie: {report}", stacklevel=1)


@pytest.mark.slow
def test_default_model_batch_invariance(default_engine: Engine) -> None:
    engine = default_engine
    # A long system message: the prompt spans several chunks at sizes 16 and 64.
    target = engine.chat_tokens(
        [
            {"role": "system", "content": " ".join(CHAT_PROMPTS)},
            {"role": "user", "content": "Describe the water cycle step by step."},
        ]
    )
    assert len(target) > 128
    others = [engine.chat_tokens(f"{text} ({i})") for i, text in enumerate(CHAT_PROMPTS * 2)]
    others = others[:31]
    new_tokens = 12
    alone = generate(engine, [target], new_tokens)[0]
    assert generate(engine, [target, *others], new_tokens)[0] == alone
    assert engine.metrics().peak_concurrent_generations == 32
    assert generate(engine, [*others, target], new_tokens)[-1] == alone
    for chunk in (16, 64, 256):
        shape = EngineShape(max_sessions=32, max_prefill_chunk=chunk, max_batch_tokens=chunk + 32)
        with Engine(engine.backend, engine.tokenizer, shape=shape) as chunked:
            assert generate(chunked, [target], new_tokens)[0] == alone


def test_engine_is_exported_from_the_package_top_level() -> None:
    import cellbatch
    from cellbatch.engine import Engine

    assert cellbatch.Engine is Engine
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = cellbatch.Nothing
