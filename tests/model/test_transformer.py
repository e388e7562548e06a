"""The packed transformer against transformers, on tiny random checkpoints (fp32).

Two sequences of different lengths are prefilled in one step, then both decode, then one
decodes while the other takes a prompt chunk (both plan groups in one forward). Every
row's logits must match transformers' forward over each sequence alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from cellbatch.model import kernels as compiled
from cellbatch.model.loading import load_model
from cellbatch.model.transformer import PackedLinear, can_pack_linears

# Both implementations, unless the compiled ones are switched off (then refused).
KERNELS = ["torch"] if compiled.disabled() else ["compiled", "torch"]
PROMPT_A = [5, 17, 33, 2, 61]
PROMPT_B = [9, 40, 12, 77, 3, 50, 21, 8, 64, 30, 11]
# (sequence, tokens) per step, in token-axis order.
STEPS = [
    [(0, PROMPT_A), (1, PROMPT_B)],
    [(1, [70]), (0, [4])],
    [(0, [19]), (1, [6, 44, 90])],
]


def rows_of(sequence: int) -> list[tuple[int, slice]]:
    """(step, row slice) of each sequence's tokens in STEPS, in position order."""
    out = []
    for step_index, step in enumerate(STEPS):
        start = 0
        for index, chunk in step:
            if index == sequence:
                out.append((step_index, slice(start, start + len(chunk))))
            start += len(chunk)
    return out


def full_sequence(sequence: int) -> list[int]:
    return [t for step in STEPS for index, chunk in step if index == sequence for t in chunk]


def compare_with_transformers(hf_model, ours: list[torch.Tensor]) -> None:
    for sequence in (0, 1):
        with torch.no_grad():
            expected = hf_model(torch.tensor([full_sequence(sequence)])).logits[0]
        got = torch.cat([ours[step][rows] for step, rows in rows_of(sequence)])
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert expected.std() > 0.5  # the check below is not vacuous
        assert (got - expected).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
        ("qwen2", {}),
        ("qwen3", {}),
        ("mistral", {"sliding_window": 4}),
    ],
    ids=["llama", "llama-tied", "llama3-rope", "qwen2", "qwen3", "mistral-window4"],
)
@pytest.mark.parametrize("kernels", KERNELS)
def test_packed_steps_match_transformers(
    tiny_checkpoint, packed_steps, kind, overrides, kernels
) -> None:
    hf_model, folder = tiny_checkpoint(kind, **overrides)
    config, model = load_model(folder, "float32", kernels)
    assert config.architecture == kind and model.ops.kind == kernels
    compare_with_transformers(hf_model, packed_steps(model, STEPS, 2))


def test_the_window_changes_the_result(tiny_checkpoint, packed_steps) -> None:
    # Guards the Mistral case above: a window shorter than the prompt must matter.
    _, folder = tiny_checkpoint("mistral", sliding_window=4)
    config, windowed = load_model(folder, "float32")
    _, full = load_model(folder, "float32")
    full.config = dataclasses.replace(config, layer_windows=(None,) * config.num_layers)
    last_b = packed_steps(windowed, STEPS, 2)[2][-1]
    assert not torch.allclose(last_b, packed_steps(full, STEPS, 2)[2][-1], atol=1e-3)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_window_layer_skips_key_blocks_outside_its_window(tiny_checkpoint, kernels) -> None:
    from cellbatch.cache import CellCache
    from cellbatch.kv_pool import KVPool
    from cellbatch.model.attention import KEY_BLOCK

    _, folder = tiny_checkpoint("mistral", sliding_window=4)
    config, model = load_model(folder, "float32", kernels)
    cache = CellCache(256)
    pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, 256)
    seq = cache.seq_alloc()

    def step(tokens: list[int]) -> torch.Tensor:
        ids = torch.full((len(tokens),), seq)
        start = cache.seq_length(seq)
        positions = torch.arange(start, start + len(tokens))
        assert cache.declare_step(ids.numpy())
        cells = cache.place_step(ids.numpy(), positions.numpy())
        pool.ensure(cache.high_water())
        plan = cache.attention_plan(ids.numpy(), positions.numpy(), cells)
        with torch.no_grad():
            return model(
                torch.tensor(tokens),
                positions,
                plan,
                pool,
                torch.from_numpy(cells),
                torch.tensor([len(tokens) - 1]),
            )

    prompt = torch.randint(0, 96, (KEY_BLOCK + 16,), generator=torch.Generator().manual_seed(3))
    step(prompt.tolist())
    clean = step([70])
    cache.seq_rewind(seq, len(prompt))
    # The decode at position 80 sees positions 77..80: the whole first block of keys is out
    # of its window. Poisoned, it must not be read at all (NaN * 0 would still be NaN).
    first_block = torch.from_numpy(cache.seq_cells(seq)[:KEY_BLOCK])
    for layer in range(config.num_layers):
        pool.k[layer][first_block] = float("nan")
        pool.v[layer][first_block] = float("nan")
    assert torch.equal(step([70]), clean)


@pytest.mark.parametrize(
    ("kind", "dtype", "overrides", "kv_dtype"),
    [
        ("llama", "float32", {}, torch.float32),
        ("llama", "bfloat16", {}, torch.float32),
        ("mistral", "float32", {"sliding_window": 8}, torch.float32),
        ("llama", "bfloat16", {}, torch.int8),
    ],
)
@pytest.mark.parametrize("kernels", KERNELS)
def test_a_sequence_is_batch_invariant(
    tiny_checkpoint, first_sequence_logits, kind, dtype, overrides, kv_dtype, kernels
) -> None:
    """Sequence 0's logits are bit-identical alone, chunked, beside others, first or last
    (with an int8 cache too: a head's quantisation reads that head alone)."""
    _, folder = tiny_checkpoint(kind, **overrides)
    _, model = load_model(folder, dtype, kernels)
    generator = torch.Generator().manual_seed(5)
    lengths = [70, 3, 100, 17, 40, 9]
    prompts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in lengths]
    decodes = [7, 31, 64]
    alone = first_sequence_logits(model, prompts, decodes, [0], 256, kv_dtype)
    assert alone.shape[0] == lengths[0] + len(decodes)
    for order, chunk in (([0], 16), ([0, 1, 2, 3, 4, 5], 256), ([5, 4, 3, 2, 1, 0], 16)):
        got = first_sequence_logits(model, prompts, decodes, order, chunk, kv_dtype)
        assert torch.equal(got, alone), (order, chunk)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_long_prompt_gives_the_same_logits_in_any_chunk_size(
    tiny_checkpoint, first_sequence_logits, kernels
) -> None:
    """A 2,000-token prompt and its decodes, chunked by 2,048 (whole), 512 or 64, alone or
    beside another prompt: bit-identical, and as transformers computes the prompt."""
    hf_model, folder = tiny_checkpoint("llama", max_position_embeddings=2048)
    _, model = load_model(folder, "float32", kernels)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 96, (n,), generator=generator).tolist() for n in (2000, 300)]
    decodes = [7, 31]
    whole = first_sequence_logits(model, prompts, decodes, [0], 2048)
    for order, chunk in (([0], 512), ([0], 64), ([1, 0], 512)):
        got = first_sequence_logits(model, prompts, decodes, order, chunk)
        assert torch.equal(got, whole), (order, chunk)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompts[0]])).logits[0]
    assert (whole[:2000] - expected).abs().max().item() < 1e-4


def test_bf16_weights_and_kv_stay_close_to_fp32(tiny_checkpoint, packed_steps) -> None:
    _, folder = tiny_checkpoint("llama")
    _, model32 = load_model(folder, "float32")
    _, model16 = load_model(folder, "bfloat16")
    assert model16.embed.weight.dtype == torch.bfloat16
    reference = packed_steps(model32, STEPS, 2)
    for kv_dtype in (torch.float32, torch.bfloat16):
        got = packed_steps(model16, STEPS, 2, kv_dtype=kv_dtype)
        for ours, ref in zip(got, reference, strict=True):
            assert ours.dtype == torch.float32
            assert (ours - ref).abs().max().item() < 0.25
    # fp32 weights with a bf16 KV pool: only the cached K/V are rounded.
    got = packed_steps(model32, STEPS, 2, kv_dtype=torch.bfloat16)
    assert 0 < (got[2] - reference[2]).abs().max().item() < 0.1


@pytest.mark.parametrize("kernels", KERNELS)
def test_an_int8_cache_stays_close_to_the_float_one(tiny_checkpoint, packed_steps, kernels) -> None:
    """bf16 weights with an int8 KV pool against the bf16 pool: within bf16's own distance
    from fp32 (the test above), and not the same (the K/V are quantised)."""
    _, folder = tiny_checkpoint("llama")
    _, model = load_model(folder, "bfloat16", kernels)
    reference = packed_steps(model, STEPS, 2, kv_dtype=torch.bfloat16)
    got = packed_steps(model, STEPS, 2, kv_dtype=torch.int8)
    worst = max((ours - ref).abs().max().item() for ours, ref in zip(got, reference, strict=True))
    assert 0 < worst < 0.25


@pytest.mark.skipif(
    not can_pack_linears(torch.bfloat16, "cpu"), reason="needs a CPU with native bf16 products"
)
@pytest.mark.parametrize("shape", [(96, 64), (576, 1536), (3072, 576)])
def test_a_bf16_packed_linear_row_does_not_depend_on_the_other_rows(shape) -> None:
    # (576, 1536) and (3072, 576) round differently by row count on AMX CPUs unless every
    # call has the same row count (cellbatch.model.gemm).
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(shape[0], generator=generator).to(torch.bfloat16)
    rows = torch.randn(300, shape[1], generator=generator).to(torch.bfloat16)
    packed = PackedLinear(weight, bias)
    full = packed(rows)
    reference = F.linear(rows.float(), weight.float(), bias.float())
    assert (full.float() - reference).abs().max() < 0.1
    for count in (1, 2, 3, 15, 16, 31, 32, 33, 100, 128, 200):
        assert torch.equal(packed(rows[:count]), full[:count]), count
    for start in (1, 7, 40):
        assert torch.equal(packed(rows[start : start + 32]), full[start : start + 32]), start


@pytest.mark.skipif(not can_pack_linears(torch.float32, "cpu"), reason="needs oneDNN")
def test_fp32_packed_linear_is_row_invariant_from_the_padded_row_count() -> None:
    from cellbatch.model.transformer import PACKED_MIN_GEMM_ROWS

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=generator) * 0.05
    rows = torch.randn(300, 1536, generator=generator)
    packed = PackedLinear(weight, None)
    full = packed(rows)
    assert torch.allclose(full, F.linear(rows, weight), atol=1e-4)
    for count in (PACKED_MIN_GEMM_ROWS, 3, 15, 16, 33, 128):
        assert torch.equal(packed(rows[:count]), full[:count]), count
    for start in (1, 7, 40):
        assert torch.equal(packed(rows[start : start + 32]), full[start : start + 32]), start
