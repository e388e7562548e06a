"""Speculative decoding never changes a token: on tiny random models, with prompt lookup
and with draft models (the model itself: every draft accepted; a slightly different
model: some), greedy and seeded sampling, alone and among 31 other prompts, under
preemption, with clones and cancels, the tokens equal the run without speculation, bit
for bit."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cellbatch.engine import Engine, EngineShape, ModuleBackend
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.model.loading import load_model
from cellbatch.speculative import SpeculativeConfig
from cellbatch.types import FinishReason, GenerationUpdate
from fake_executor import WAIT_S
from tiny_models import make_tiny_checkpoint

VOCAB = 96
NO_EOS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
NEW_TOKENS = 24
NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase of theirs, as a text to be rewritten does."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 10))]
        filler = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        prompts.append([*phrase, *filler, *phrase, *filler, *phrase[: rng.randint(1, 4)]])
    return prompts


PROMPTS = _prompts(32)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModuleBackend]:
    """The target, and a draft that differs from it a little (the same draws, scaled)."""
    root = tmp_path_factory.mktemp("speculative")
    backends = {}
    for name, std in (("target", 0.15), ("other", 0.16)):
        folder = make_tiny_checkpoint("llama", root / name, std=std, **NO_EOS)[1]
        config, module = load_model(folder, "float32")
        backends[name] = ModuleBackend(module, config)
    return backends


MakeEngine = Callable[..., Engine]


@pytest.fixture
def make_engine(models: dict[str, ModuleBackend]) -> Iterator[MakeEngine]:
    made: list[Engine] = []

    def make(speculative: str | None = None, **shape: object) -> Engine:
        """speculative: None, "ngram", "self" (the target drafts) or "other"."""
        config, draft = None, None
        if speculative == "ngram":
            config = NGRAM
        elif speculative is not None:
            config = SpeculativeConfig("draft_model", num_speculative_tokens=4, model="tiny")
            draft = models["target" if speculative == "self" else speculative]
        options = {"max_sessions": 40, "max_batch_tokens": 256, **shape}
        made.append(
            Engine(
                models["target"],
                None,
                shape=EngineShape(**options),  # type: ignore[arg-type]
                speculative=config,
                draft=draft,
            )
        )
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def _tokens(engine: Engine, prompts: list[list[int]], config: GenConfig) -> list[list[int]]:
    results = engine.generate(prompts, config, share_prefix=False)
    for result in results:
        assert result.ok, result.error
    return [result.tokens for result in results]


CONFIGS = {
    "greedy": GenConfig(max_new_tokens=NEW_TOKENS),
    "sampled": GenConfig(max_new_tokens=NEW_TOKENS, sampling=SAMPLED, seed=1234),
}


@pytest.mark.parametrize("sampling", sorted(CONFIGS))
@pytest.mark.parametrize("speculative", ["ngram", "self", "other"])
def test_tokens_equal_the_run_without_speculation_alone_and_among_31_others(
    make_engine: MakeEngine, speculative: str, sampling: str
) -> None:
    config = CONFIGS[sampling]
    expected = _tokens(make_engine(), PROMPTS, config)
    engine = make_engine(speculative)
    together = _tokens(engine, PROMPTS, config)
    assert together == expected
    for index, prompt in enumerate(PROMPTS):
        # Seeded prompts take seed + index in a batch: alone, each keeps its own.
        alone = GenConfig(
            max_new_tokens=NEW_TOKENS,
            sampling=config.sampling,
            seed=None if config.seed is None else config.seed + index,
        )
        assert _tokens(engine, [prompt], alone) == [expected[index]], index
    metrics = engine.metrics()
    assert metrics.spec_draft_tokens > 0
    rate = metrics.spec_acceptance_rate
    assert rate is not None
    if speculative == "self" and sampling == "greedy":
        assert rate == 1.0  # a model drafting for itself, greedily, is always right
    elif speculative in ("self", "other"):
        assert 0.0 < rate < 1.0
    if sampling == "greedy":
        assert metrics.spec_accepted_tokens > 0


@pytest.mark.parametrize("speculative", ["ngram", "other"])
def test_preemption_under_a_small_pool_changes_no_token(
    make_engine: MakeEngine, speculative: str
) -> None:
    # Each generation grows past the cells its start left free: the pool runs short.
    config = GenConfig(max_new_tokens=64, sampling=SAMPLED, seed=99)
    expected = _tokens(make_engine(), PROMPTS, config)
    engine = make_engine(speculative, max_cells=256)
    assert _tokens(engine, PROMPTS, config) == expected
    metrics = engine.metrics()
    assert metrics.preemptions > 0
    assert metrics.spec_draft_tokens > 0


def test_clones_of_one_prompt_draft_from_their_own_cells(make_engine: MakeEngine) -> None:
    """`n` choices of one prompt: the prompt is fed once and cloned; each clone's draft
    session is a clone of the root's."""
    config = GenConfig(max_new_tokens=NEW_TOKENS, sampling=SAMPLED, seed=7)
    prompts = [PROMPTS[0] * 2] * 4
    expected = make_engine().generate(prompts, config)
    engine = make_engine("self")
    results = engine.generate(prompts, config)
    assert [r.tokens for r in results] == [r.tokens for r in expected]
    assert results[0].shared_prefix_tokens > 0
    assert engine.metrics().spec_draft_tokens > 0


@pytest.mark.parametrize("speculative", ["ngram", "self"])
def test_a_turn_cancelled_mid_verification_leaves_the_delivered_tokens(
    make_engine: MakeEngine, speculative: str
) -> None:
    """A cancel lands while a verified run is in flight: the session holds exactly what
    was delivered, and its next turn continues from there as without speculation."""
    engine = make_engine(speculative)
    plain = make_engine()
    session = engine.open_session()
    delivered: list[int] = []
    first, posted = threading.Event(), threading.Event()

    def on_update(update: GenerationUpdate) -> None:
        delivered.extend(update.tokens)
        if update.finish_reason is None and len(delivered) >= 3:
            first.set()
            posted.wait(WAIT_S)  # hold the engine until the cancel is posted

    prompt = PROMPTS[3]
    handle = session.generate_async(prompt, GenConfig(max_new_tokens=64), on_update)
    assert first.wait(WAIT_S)
    handle.cancel()
    posted.set()
    assert handle.wait(WAIT_S)
    assert handle.finish_reason() == FinishReason.CANCELLED
    assert session.position() + len(session.unfed()) == len(prompt) + len(delivered)
    follow = session.generate_async([5, 6, 7], GenConfig(max_new_tokens=NEW_TOKENS))
    assert follow.wait(WAIT_S)
    context = [*prompt, *delivered, 5, 6, 7]
    assert follow.tokens() == _tokens(plain, [context], GenConfig(max_new_tokens=NEW_TOKENS))[0]
    session.close()


def test_the_draft_model_must_share_the_vocabulary(
    models: dict[str, ModuleBackend], tmp_path: Path
) -> None:
    folder = make_tiny_checkpoint("llama", tmp_path / "wide", vocab_size=128, **NO_EOS)[1]
    config, module = load_model(folder, "float32")
    with pytest.raises(ValueError, match="vocabulary of 128 tokens, the model 96"):
        Engine(
            models["target"],
            None,
            speculative=SpeculativeConfig("draft_model", model=str(folder)),
            draft=ModuleBackend(module, config),
        )
