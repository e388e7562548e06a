"""Embeddings from the engine: `Engine.embed` against transformers' pooled last hidden
states (fp32, 1e-4), across prompt chunks, beside generations, under preemption, and the
sizes a model allows."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from cellbatch.engine import Engine
from cellbatch.engine.embedding import embedding_size, finish_embedding
from cellbatch.executor.pooling import Pooler, plan_pooling
from cellbatch.generation_config import GenConfig, SamplingParams
from cellbatch.types import InvalidArgumentError
from tiny_models import make_tiny_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], list(range(7, 60)), [9], list(range(60, 91))]  # vocabulary: 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, folder = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("embed") / "llama")
    return folder


@pytest.fixture(scope="module")
def engine(tiny: Path) -> Iterator[Engine]:
    # Chunks of 8: most prompts are pooled across several steps.
    with Engine.from_pretrained(
        tiny, dtype="float32", kernels="torch", max_sessions=8, max_batch_tokens=24,
        max_decode_sequences=8, max_prefill_chunk=8,
    ) as made:  # fmt: skip
        yield made


def reference(folder: Path, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    """transformers' last_hidden_state (after the final norm), pooled and normalised."""
    import transformers

    model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
            vectors.append((pooled / pooled.norm()).numpy())
    return vectors


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_hidden_states(
    engine: Engine, tiny: Path, pooling: str
) -> None:
    ours = engine.embed(PROMPTS, pooling=pooling)
    for vector, expected in zip(ours, reference(tiny, PROMPTS, pooling), strict=True):
        assert len(vector) == engine.geometry.hidden_size
        np.testing.assert_allclose(np.asarray(vector), expected, atol=1e-4, rtol=0)
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-5


def test_an_embedding_is_the_same_alone_and_beside_generations(engine: Engine) -> None:
    alone = [engine.embed([PROMPTS[1]], pooling=pooling)[0] for pooling in ("last", "mean")]
    batch = engine.generate_async([list(range(20, 50))] * 3, GenConfig(max_new_tokens=12))
    beside = [engine.embed([PROMPTS[1]], pooling=pooling)[0] for pooling in ("last", "mean")]
    assert all(result.ok for result in batch.results())
    assert beside[0] == alone[0]  # the last token's hidden state: bit for bit
    # The mean adds the chunks' sums as they came, which the other work may cut apart.
    np.testing.assert_allclose(beside[1], alone[1], atol=1e-6, rtol=0)


def test_mean_pooling_counts_each_position_once_when_preempted(tiny: Path) -> None:
    # Steps of 2 tokens (a decode and one prompt token): the 100-token embedding is fed
    # while the generation grows, until the 174-cell pool runs short and the newest (the
    # embedding) is preempted; it resumes once the generation ends, pooling only the
    # positions it had not pooled.
    prompt = [(7 * k + 3) % 96 for k in range(100)]
    with Engine.from_pretrained(
        tiny, dtype="float32", kernels="torch", max_sessions=2, max_batch_tokens=2,
        max_decode_sequences=1, max_prefill_chunk=1, max_cells=174,
    ) as small:  # fmt: skip
        generation = small.generate_async(
            [list(range(10))], GenConfig(max_new_tokens=120, stop_tokens=frozenset())
        )
        [ours] = small.embed([prompt], pooling="mean")
        assert generation.results()[0].ok
        assert small.metrics().preemptions >= 1
    [expected] = reference(tiny, [prompt], "mean")
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)


def test_raw_vectors_and_token_free_results(engine: Engine) -> None:
    [handle] = engine.embed_async([PROMPTS[0]], pooling="last")
    result = handle.result(5.0)
    assert result.tokens == () and len(result.embedding) == engine.geometry.hidden_size
    raw = engine.embed([PROMPTS[0]], normalize=False)[0]
    np.testing.assert_allclose(raw, np.asarray(result.embedding, dtype=np.float32), rtol=1e-6)


def test_bad_inputs_are_refused_before_anything_runs(engine: Engine) -> None:
    with pytest.raises(InvalidArgumentError, match="input 1: the prompt is empty"):
        engine.embed([[1, 2], []])
    vocab = engine.geometry.vocab_size
    with pytest.raises(InvalidArgumentError, match=f"input 0: token id {vocab} at index 1"):
        engine.embed([[1, vocab]])
    with pytest.raises(InvalidArgumentError, match="pooling must be one of last, mean"):
        engine.embed([[1, 2]], pooling="max")
    with pytest.raises(InvalidArgumentError, match="not trained to shorten"):
        engine.embed([[1, 2]], dimensions=8)
    assert engine.embedding_size(engine.geometry.hidden_size) == engine.geometry.hidden_size


def test_a_matryoshka_model_shortens_its_embeddings(tiny: Path, tmp_path: Path) -> None:
    folder = tmp_path / "matryoshka"
    folder.mkdir()
    for item in tiny.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    hidden = config["hidden_size"]
    config["matryoshka_dimensions"] = [hidden, 16, 8]
    (folder / "config.json").write_text(json.dumps(config))
    with Engine.from_pretrained(folder, dtype="float32", kernels="torch", max_sessions=2) as m:
        full = m.embed([PROMPTS[0]], normalize=False)[0]
        [short] = m.embed([PROMPTS[0]], dimensions=8)
        with pytest.raises(InvalidArgumentError, match="give one of 8, 16"):
            m.embed([PROMPTS[0]], dimensions=12)
    expected = np.asarray(full[:8]) / np.linalg.norm(full[:8])
    np.testing.assert_allclose(short, expected, atol=1e-6)


def test_sizes_and_finishing() -> None:
    assert embedding_size(64, None, None) == 64
    assert embedding_size(64, (), 10) == 10  # is_matryoshka: any size
    with pytest.raises(InvalidArgumentError, match="above this model's 64-dimensional"):
        embedding_size(64, (), 65)
    np.testing.assert_allclose(finish_embedding([3.0, 4.0, 12.0], 2), [0.6, 0.8])
    assert finish_embedding([0.0, 0.0], 2).tolist() == [0.0, 0.0]


def test_pooling_plans_skip_positions_already_pooled() -> None:
    mean, last = Pooler("mean"), Pooler("last")
    mean.add(np.arange(0, 8), torch.ones(8, 4))  # positions 0-7 were pooled, then preempted
    plan = plan_pooling(
        [mean, None, last],
        starts=[0, 5, 0],
        sizes=[12, 1, 6],
        produces=np.array([True, True, True]),
        ends=np.array([12, 13, 19]),
    )
    assert plan is not None
    assert plan.ranges.tolist() == [[8, 12], [0, 0], [18, 19]]  # mean: only 8-11 are new
    assert plan.done_rows.tolist() == [11, -1, 18]


def test_a_pooling_policy_is_refused_where_the_executor_gives_logits_only() -> None:
    from cellbatch.executor.cell_executor import CellExecutor, ExecutorShape
    from tiny_models import head_geometry

    class LogitsOnly(CellExecutor):
        def slices(self, total):  # type: ignore[no-untyped-def]
            raise AssertionError("not run")

    executor = LogitsOnly(head_geometry(2, 1, 8), ExecutorShape(max_sessions=1))
    executor.initialize()
    sid = executor.open_session()
    assert sid is not None
    with pytest.raises(InvalidArgumentError, match="cannot give hidden states"):
        executor.set_sampling(sid, SamplingParams(pooling="last"), None)
