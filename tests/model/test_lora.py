"""LoRA adapters on the model: reading PEFT's files, the lora_add op, and a model with
adapters against transformers + PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cellbatch.model import ops as model_ops
from cellbatch.model.adapters import AdapterBank
from cellbatch.model.config import ModelConfig
from cellbatch.model.loading import load_model
from cellbatch.model.lora import AdapterError, ProductLora, int8_pair, read_adapter
from cellbatch.types import InvalidArgumentError, OutOfResourcesError
from lora_adapters import make_adapter, peft_model
from tiny_models import make_tiny_checkpoint

STEPS = [[(0, [5, 17, 33, 2, 61]), (1, [9, 40, 12])], [(1, [70]), (0, [4])], [(0, [8]), (1, [3])]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama (transformers' fp32 model, its folder) and its config."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf_model, _ = make_tiny_checkpoint("llama", folder)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    return hf_model, folder, config


# -- reading PEFT's files ----------------------------------------------------------------


def test_an_adapter_on_q_alone_adds_to_the_first_columns_of_qkv(tiny, tmp_path) -> None:
    hf_model, _, config = tiny
    folder = make_adapter(hf_model, tmp_path / "q", ["q_proj", "up_proj"], rank=4, alpha=8)
    adapter = read_adapter(folder, config, torch.float32)
    assert adapter.targets == ("q_proj", "up_proj") and adapter.rank == 4
    qkv, gate_up = adapter.layers[0]["qkv"], adapter.layers[0]["gate_up"]
    assert set(adapter.layers[0]) == {"qkv", "gate_up"}
    assert qkv.segments.tolist() == [[0, 4, 0, config.q_size]]
    assert gate_up.segments.tolist() == [[0, 4, config.intermediate_size, config.intermediate_size]]
    weights = load_file(str(folder / "adapter_model.safetensors"))
    a = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(qkv.a, a)
    assert torch.allclose(qkv.b.view(4, -1), (b * 2.0).t())  # alpha / r = 2


@pytest.mark.parametrize(
    ("rslora", "pattern", "scale"), [(False, {}, 4.0), (True, {}, 8.0), (False, {"v_proj": 4}, 1.0)]
)
def test_the_scale_is_alpha_over_rank_or_its_root(tiny, tmp_path, rslora, pattern, scale) -> None:
    hf_model, _, config = tiny
    folder = make_adapter(
        hf_model, tmp_path / "s", ["v_proj"], rank=4, alpha=16, rslora=rslora,
        alpha_pattern=pattern,
    )  # fmt: skip
    adapter = read_adapter(folder, config, torch.float32)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    b = weights["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    qkv = adapter.layers[1]["qkv"]
    assert qkv.segments.tolist() == [[0, 4, config.q_size + config.kv_size, config.kv_size]]
    assert torch.allclose(qkv.b.view(4, -1), (b * scale).t())


def test_int8_adapters_hold_a_row_per_rank_within_half_a_step(tiny, tmp_path) -> None:
    """Beside a quantised base: A's and B's rows per rank in int8, each value within half
    a step of its float value, the scales folded into one per rank; half the bytes."""
    hf_model, _, config = tiny
    folder = make_adapter(hf_model, tmp_path / "all", rank=8, seed=3)
    exact = read_adapter(folder, config, torch.float32)
    held = read_adapter(folder, config, torch.bfloat16, int8=True)
    assert held.int8 and not exact.int8
    assert held.nbytes < 0.3 * exact.nbytes  # int8 against float32, beside small scales
    for product in ("qkv", "gate_up", "down"):
        want, got = exact.layers[0][product], held.layers[0][product]
        assert got.a.dtype == got.b.dtype == torch.int8 and got.scales.shape == (want.rank,)
        a_step = want.a.abs().amax(dim=1) / 127
        assert (
            (got.a.float() * a_step[:, None] - want.a).abs() <= a_step[:, None] / 2 + 1e-7
        ).all()
        start = 0
        for rank_start, ranks, _, columns in want.segments.tolist():
            rows = want.b[start : start + ranks * columns].view(ranks, columns)
            b_step = rows.abs().amax(dim=1)[:, None] / 127
            quantised = got.b[start : start + ranks * columns].view(ranks, columns).float()
            assert ((quantised * b_step - rows).abs() <= b_step / 2 + 1e-7).all()
            scales = a_step[rank_start : rank_start + ranks] * b_step[:, 0]
            torch.testing.assert_close(got.scales[rank_start : rank_start + ranks], scales)
            start += ranks * columns
    zero = int8_pair(
        ProductLora(
            torch.zeros(2, 8), torch.zeros(2 * 4), torch.tensor([[0, 2, 0, 4]]), torch.empty(0)
        )
    )
    assert zero.scales.tolist() == [0.0, 0.0] and not zero.a.any()


def _rewrite(folder: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    if config is not None:
        raw = json.loads((folder / "adapter_config.json").read_text())
        raw.update(config)
        (folder / "adapter_config.json").write_text(json.dumps(raw))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"config": {"peft_type": "IA3"}}, "peft_type is 'IA3'"),
        ({"config": {"use_dora": True}}, "DoRA"),
        ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
        ({"config": {"target_modules": ["q_proj", "c_attn"]}}, r"\['c_attn'\] are not among"),
        ({"config": {"lora_alpha": "big"}}, "lora_alpha must be a number"),
        ({"extra": ("layers.0.self_attn.c_attn.lora_A.weight", (4, 64))}, "no adaptable module"),
        ({"extra": ("layers.7.self_attn.q_proj.lora_A.weight", (4, 64))}, "layer 7, but the"),
        ({"extra": ("base_model.model.lm_head.weight", (96, 64))}, "unexpected tensor"),
        ({"drop": "lora_B"}, "lora_A and lora_B both needed"),
        ({"reshape": (4, 48)}, r"expected lora_A \[r, 64\].*another base model"),
    ],
)
def test_a_bad_adapter_is_refused_naming_the_file_and_the_mismatch(
    tiny, tmp_path, change, message
) -> None:
    hf_model, _, config = tiny
    folder = make_adapter(hf_model, tmp_path / "bad", ["q_proj", "k_proj"], rank=4)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    first = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    if "extra" in change:
        name, shape = change["extra"]
        tensors[name] = torch.zeros(shape)
    if "drop" in change:
        del tensors[first.replace("lora_A", change["drop"])]
    if "reshape" in change:
        tensors[first] = torch.zeros(change["reshape"])
    _rewrite(folder, change.get("config"), tensors)
    with pytest.raises(AdapterError, match=message) as caught:
        read_adapter(folder, config, torch.float32)
    assert str(folder) in str(caught.value)


def test_missing_files_say_what_a_peft_folder_holds(tiny, tmp_path) -> None:
    _, _, config = tiny
    with pytest.raises(AdapterError, match="not a folder"):
        read_adapter(tmp_path / "nowhere", config, torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match=r"adapter_config\.json is missing"):
        read_adapter(tmp_path / "empty", config, torch.float32)
    (tmp_path / "empty" / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 8}'
    )
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors is missing"):
        read_adapter(tmp_path / "empty", config, torch.float32)


def test_a_step_of_a_layout_seen_before_is_the_one_built_then(tiny, tmp_path) -> None:
    hf_model, _, config = tiny
    bank = AdapterBank(config, torch.float32)
    bank.load("a", make_adapter(hf_model, tmp_path / "a", ["q_proj"], rank=4))
    bank.load("b", make_adapter(hf_model, tmp_path / "b", ["down_proj"], rank=2))
    a, b = bank.acquire("a"), bank.acquire("b")
    first = bank.step(np.array([b, 0, a, b]))
    assert first is not None and bank.step(np.array([b, 0, a, b])) is first
    other = bank.step(np.array([a, 0, a, b]))
    assert other is not None and other is not first
    layer = other.layers[0]
    assert layer is not None
    assert layer.rows.tolist() == [0, 2, 3] and layer.offsets.tolist() == [0, 2, 3]


def test_a_bank_loads_names_once_and_frees_an_adapter_after_its_last_use(tiny, tmp_path) -> None:
    hf_model, _, config = tiny
    folder = make_adapter(hf_model, tmp_path / "a", ["q_proj"], rank=4)
    bank = AdapterBank(config, torch.float32, max_loras=2)
    bank.load("a", folder)
    with pytest.raises(InvalidArgumentError, match="already loaded"):
        bank.load("a", folder)
    bank.load("b", folder)
    with pytest.raises(OutOfResourcesError, match="max_loras=2"):
        bank.load("c", folder)
    held = bank.acquire("a")
    bank.unload("a")
    assert [info.name for info in bank.adapters()] == ["b"]
    with pytest.raises(InvalidArgumentError, match="no LoRA adapter named 'a'"):
        bank.acquire("a")
    assert bank.step(np.array([held, 0])) is not None  # the running generation keeps it
    with pytest.raises(OutOfResourcesError):
        bank.load("c", folder)  # a draining adapter still holds its weights
    bank.release(held, 5, 3)
    assert bank.holding() == 1
    for layout in ([held], [held, 0]):  # [held, 0]: a layout the bank has built a step for
        with pytest.raises(InvalidArgumentError, match="weights are gone"):
            bank.step(np.array(layout))
    again = bank.load("a", folder)
    assert again.name == "a" and bank.acquire("a") != held  # a new id: a new adapter
    assert bank.usage()["a"].generations == 2 and bank.usage()["a"].generated_tokens == 3
    assert bank.step(np.zeros(4, dtype=np.int64)) is None


# -- the op ------------------------------------------------------------------------------


def group_weights(
    a: torch.Tensor, b: torch.Tensor, segments: list, dtype: torch.dtype, int8: bool
) -> list[torch.Tensor]:
    """One group's (a, b, segments, scales) for lora_add from float32 A and B: A and B in
    `dtype`, or int8 with their scales."""
    pair = ProductLora(a, b, torch.tensor(segments), torch.empty(0))
    if int8:
        pair = int8_pair(pair)
        return [pair.a, pair.b, pair.segments, pair.scales]
    return [a.to(dtype), b.to(dtype), pair.segments, pair.scales]


def lora_inputs(dtype: torch.dtype, seed: int = 5, inputs: int = 64, int8: bool = False) -> tuple:
    """lora_add's arguments: 7 rows of `inputs` into 96 outputs, two groups (rows 1, 4, 6
    and rows 0, 5), the first with two modules (columns 0..31 and 64..95), ranks 8 and 4;
    A and B in `dtype`, or int8 with their scales."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    first = group_weights(
        randn(12, inputs), randn(8 * 32 + 4 * 32), [[0, 8, 0, 32], [8, 4, 64, 32]], dtype, int8
    )
    second = group_weights(randn(3, inputs), randn(3 * 96), [[0, 3, 0, 96]], dtype, int8)
    return (
        randn(7, 96).to(dtype),
        randn(7, inputs).to(dtype),
        torch.tensor([1, 4, 6, 0, 5]),
        torch.tensor([0, 3, 5]),
        [*first, *second],
    )


def lora_reference(out, x, rows, offsets, weights) -> torch.Tensor:
    """x · A · B per row in float64 (int8 A and B: times their scales), added to out."""
    expected = out.double().clone()
    bounds = offsets.tolist()
    for group in range(len(bounds) - 1):
        a, b, segments, scales = weights[4 * group : 4 * group + 4]
        start = 0
        for rank_start, ranks, column, columns in segments.tolist():
            block = b[start : start + ranks * columns].view(ranks, columns).double()
            start += ranks * columns
            for row in rows[bounds[group] : bounds[group + 1]].tolist():
                low = a.double()[rank_start : rank_start + ranks] @ x[row].double()
                if scales.numel():
                    low = low * scales.double()[rank_start : rank_start + ranks]
                expected[row, column : column + columns] += low @ block
    return expected


# 70 inputs: a tail shorter than a vector after the whole ones.
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("inputs", [64, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_adds_each_groups_low_rank_product_to_its_rows(table, dtype, inputs, int8) -> None:
    out, x, rows, offsets, weights = lora_inputs(dtype, inputs=inputs, int8=int8)
    before = out.clone()
    table.lora_add(out, x, rows, offsets, weights)
    expected = lora_reference(before, x, rows, offsets, weights)
    # float32: the sums' order; bf16: the one rounding of the result (half an ulp).
    rtol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=1e-4)
    assert torch.equal(out[[2, 3]], before[[2, 3]])  # rows without an adapter: untouched


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_low_rank_product_does_not_depend_on_the_other_rows(table, dtype, int8) -> None:
    """Row 4 of group 0 alone, then beside 40 rows of three groups in another order: the
    same bits (compiled: one chain per row; torch: calls of LORA_ROWS_PER_CALL rows)."""
    out, x, _, _, weights = lora_inputs(dtype, int8=int8)
    alone = out.clone()
    table.lora_add(alone, x, torch.tensor([4]), torch.tensor([0, 1]), weights[:4])
    big_x = torch.cat([x, torch.randn(40, 64).to(dtype)])
    big_out = torch.cat([out, torch.randn(40, 96).to(dtype)])
    first = torch.tensor([*range(7, 27), 4, *range(27, 40)])
    rows = torch.cat([first, torch.tensor([40, 41]), torch.tensor([0, 1])])
    table.lora_add(big_out, big_x, rows, torch.tensor([0, 34, 36, 38]), weights[:4] * 3)
    assert torch.equal(alone[4], big_out[4])


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "segments",
    [
        [[0, 64, 0, 1200], [64, 32, 1200, 1000]],
        [[0, 64, 0, 2100]],
        [[0, 32, 0, 96], [32, 96, 96, 800]],
    ],
)
def test_a_lone_rows_product_spread_over_threads_gives_one_threads_bits(
    compiled_ops, segments, dtype, int8
) -> None:
    """A few rows with an adapter large enough for a parallel region (over kParallelValues
    weight values): the call splits the modules' columns over the threads (each piece
    computing its module's x · A again); every row keeps the bits of one thread's run and
    of a run beside 40 other rows. The columns end in part blocks."""
    generator = torch.Generator().manual_seed(11)
    ranks = sum(s[1] for s in segments)
    width = max(s[2] + s[3] for s in segments)
    # 600 inputs: a tail after whole vectors (and after bf16's 32-value loads)
    a = torch.randn(ranks, 600, generator=generator)
    b = torch.randn(sum(s[1] * s[3] for s in segments), generator=generator)
    weights = group_weights(a, b, segments, dtype, int8)
    x = torch.randn(43, 600, generator=generator).to(dtype)
    out = torch.randn(43, width, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    results = {}
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in ([5], [5, 9, 2]):
                result = out.clone()
                compiled_ops.lora_add(
                    result, x, torch.tensor(rows), torch.tensor([0, len(rows)]), weights
                )
                results[count, len(rows)] = result
        torch.set_num_threads(2)
        crowd = out.clone()
        crowd_rows = torch.tensor([*range(10, 43), 5, 9, 2, *range(0, 2)])
        crowd_offsets = torch.tensor([0, len(crowd_rows)])
        compiled_ops.lora_add(crowd, x, crowd_rows, crowd_offsets, weights)
    finally:
        torch.set_num_threads(threads)
    for (count, size), result in results.items():
        adapted = [5, 9, 2][:size]
        assert torch.equal(result[adapted], crowd[adapted]), (count, size)
        untouched = [r for r in range(43) if r not in adapted]
        assert torch.equal(result[untouched], out[untouched]), (count, size)
    expected = lora_reference(out, x, crowd_rows, crowd_offsets, weights)
    # float32: the sums' order; bf16: the one rounding of the result (half an ulp).
    rtol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(crowd.double(), expected, rtol=rtol, atol=1e-3)


def test_lora_add_refuses_what_it_cannot_run(compiled_ops) -> None:
    out, x, rows, offsets, weights = lora_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="8 weight tensors"):
        compiled_ops.lora_add(out, x, rows, offsets, weights[:4])
    with pytest.raises(RuntimeError, match="row 9 is outside"):
        compiled_ops.lora_add(out, x, torch.tensor([1, 4, 9, 0, 5]), offsets, weights)
    bad = [*weights[:2], torch.tensor([[0, 8, 90, 32]]), *weights[3:]]
    with pytest.raises(RuntimeError, match="segment 0"):
        compiled_ops.lora_add(out, x, rows, offsets, bad)
    quantised = lora_inputs(torch.float32, int8=True)[4]
    unscaled = [*quantised[:3], torch.empty(0), *quantised[4:]]
    with pytest.raises(RuntimeError, match="int8 where the group has scales"):
        compiled_ops.lora_add(out, x, rows, offsets, unscaled)
    short = [*quantised[:3], quantised[3][:5], *quantised[4:]]
    with pytest.raises(RuntimeError, match=r"scales must be contiguous float32 \[12\]"):
        compiled_ops.lora_add(out, x, rows, offsets, short)


@pytest.fixture(params=["compiled", "torch"])
def table(request, compiled_ops, torch_ops) -> model_ops.Ops:
    return compiled_ops if request.param == "compiled" else torch_ops


# -- a model with adapters against transformers + PEFT -------------------------------------


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_a_model_with_an_adapter_gives_peft_logits(tiny, tmp_path, packed_steps, kernels) -> None:
    """Two sequences, one with an adapter on every module, one on the base: each gets
    the logits transformers + PEFT give it (fp32)."""
    hf_model, folder, config = tiny
    adapter = make_adapter(hf_model, tmp_path / "all", rank=8, seed=1)
    _, model = load_model(folder, "float32", kernels, "none")
    bank = AdapterBank(config, torch.float32)
    bank.load("all", adapter)
    ours = packed_steps(model, STEPS, 2, adapters=(bank, [bank.acquire("all"), 0]))
    reference = peft_model(hf_model, adapter)
    for sequence, hf in ((0, reference), (1, hf_model)):
        tokens = [t for step in STEPS for s, chunk in step if s == sequence for t in chunk]
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0]
        got = torch.cat(
            [
                logits[[i for i, (s, c) in enumerate(_rows(step)) if s == sequence]]
                for logits, step in zip(ours, STEPS, strict=True)
            ]
        )
        assert (got - expected).abs().max() < 1e-4, sequence
    with torch.no_grad():
        plain = hf_model(torch.tensor([[5, 17, 33]])).logits
        adapted = reference(torch.tensor([[5, 17, 33]])).logits
    assert (plain - adapted).abs().max() > 0.1  # the adapter does move the logits


def _rows(step: list) -> list[tuple[int, int]]:
    return [(sequence, token) for sequence, chunk in step for token in chunk]


@pytest.mark.parametrize(("dtype", "activations"), [("float32", "float"), ("bfloat16", "int8")])
def test_a_layer_run_as_one_op_with_adapters_gives_the_bits_of_its_steps(
    tiny, tmp_path, compiled_ops, packed_steps, dtype, activations
) -> None:
    """An int4 model's one-op layers with two adapters (and a base row) against the same
    layers run step by step: adapters work inside decoder_layer."""
    hf_model, folder, config = tiny
    _, model = load_model(folder, dtype, "compiled", "int4", activations=activations)
    bank = AdapterBank.for_model(model, config)
    assert bank.int8  # int8 adapters inside decoder_layer
    bank.load("qv", make_adapter(hf_model, tmp_path / "qv", ["q_proj", "v_proj"], rank=4))
    bank.load("mlp", make_adapter(hf_model, tmp_path / "mlp", ["down_proj", "up_proj"], seed=2))
    ids = [bank.acquire("qv"), bank.acquire("mlp")]
    assert model.fuse_layers() == config.num_layers
    kv_dtype = model.dtype
    fused = packed_steps(model, STEPS, 2, kv_dtype, adapters=(bank, ids))
    assert model.fuse_layers(False) == 0
    stepwise = packed_steps(model, STEPS, 2, kv_dtype, adapters=(bank, ids))
    plain = packed_steps(model, STEPS, 2, kv_dtype)
    for one_op, steps, base in zip(fused, stepwise, plain, strict=True):
        assert torch.equal(one_op, steps)
        assert not torch.equal(one_op, base)


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_an_int4_base_with_an_adapter_stays_within_int4s_agreement(
    tiny, tmp_path, packed_steps, kernels
) -> None:
    """int4 weights with an adapter (held in int8 beside them) against float weights with
    the same adapter (float32): the relative logits error int4 keeps on these tiny random
    weights without one (the quantised tests' bound), for the adapter's rows and the
    base's alike; and the int4 model with its adapter in int8 against it in float32: the
    adapter's int8 rows move the logits far less than int4 does."""
    hf_model, folder, config = tiny
    adapter = make_adapter(hf_model, tmp_path / "all", rank=8, seed=4)
    logits = {}
    for fmt, held in (("int4", "int8"), ("none", "float32"), ("int4", "float32")):
        _, model = load_model(folder, "float32", kernels, fmt, activations="float")
        bank = AdapterBank(config, torch.float32, int8=held == "int8")
        if held == "int8" or fmt == "none":  # what the bank of this model holds
            assert AdapterBank.for_model(model, config).int8 == (held == "int8")
        assert bank.load("all", adapter).weights == held
        steps = packed_steps(model, STEPS, 2, adapters=(bank, [bank.acquire("all"), 0]))
        logits[fmt, held] = torch.cat(steps)
    rows = {
        s: [i for i, (seq, _) in enumerate(r for st in STEPS for r in _rows(st)) if seq == s]
        for s in (0, 1)
    }
    for sequence in (0, 1):
        got = logits["int4", "int8"][rows[sequence]]
        reference = logits["none", "float32"][rows[sequence]]
        assert ((got - reference).norm() / reference.norm()).item() < 0.5
    adapted = rows[0]
    got, reference = logits["int4", "int8"][adapted], logits["int4", "float32"][adapted]
    assert ((got - reference).norm() / reference.norm()).item() < 0.02
    base = rows[1]
    assert torch.equal(logits["int4", "int8"][base], logits["int4", "float32"][base])
