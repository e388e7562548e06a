"""The repacked-weights cache (cellbatch.model.weights_cache) through `load_model`: a
second load maps what the first converted, with the same logits; a changed file, option
or layout is never served a stale entry; float models are not cached; and the load's
memory checks and phases. Kept K-quant blocks are cached as the int8/int4 products are."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cellbatch.machine import FileMappings, MemoryInfo
from cellbatch.model import kquants, loading, weights_cache
from cellbatch.model.loading import load_model
from cellbatch.types import InvalidArgumentError
from tiny_models import write_gguf

TOKENS = [5, 17, 33, 2, 61, 9, 40, 12, 3, 70]


def logits(packed_steps, model) -> torch.Tensor:
    return packed_steps(model, [[(0, TOKENS[:7])], [(0, TOKENS[7:8])], [(0, TOKENS[8:])]], 1)


def loaded(path: Path, cache: Path | None, **options):
    """(model, the phase lines of its load)."""
    phases: list[str] = []
    _, model = load_model(
        path, cache=cache, progress=lambda what, seconds: phases.append(what), **options
    )
    return model, phases


@pytest.fixture
def quantised_gguf(tiny_checkpoint, tmp_path) -> Path:
    """A tiny Llama as GGUF, projections Q4_1 and Q8_0, the rest float (an untied head)."""
    hf_model, _ = tiny_checkpoint("llama")
    file = tmp_path / "tiny.gguf"

    def kinds(name: str) -> str | None:
        if name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_down.weight")):
            return "Q4_1"
        return "Q8_0" if name.endswith(("attn_output.weight", "output.weight")) else None

    write_gguf(hf_model, file, "llama", kinds=kinds)
    return file


@pytest.mark.parametrize("kernels", ["compiled", "torch"])
def test_a_second_load_maps_what_the_first_converted(
    quantised_gguf, tmp_path, packed_steps, kernels
) -> None:
    cache = tmp_path / "cache"
    first, phases = loaded(quantised_gguf, cache, dtype="bfloat16", kernels=kernels)
    assert any(p.startswith("read and converted the weights of tiny.gguf") for p in phases)
    written = [p for p in phases if p.startswith("wrote the repacked weights to")]
    assert len(written) == 1 and len(list(cache.iterdir())) == 1
    second, phases = loaded(quantised_gguf, cache, dtype="bfloat16", kernels=kernels)
    assert [p.split(" ")[0] for p in phases] == ["read", "mapped", "prepared"]
    assert weights_cache.describe_modules(second) == weights_cache.describe_modules(first)
    for ours, theirs in zip(logits(packed_steps, second), logits(packed_steps, first), strict=True):
        assert torch.equal(ours, theirs)
    # The weights are the entry's pages: mapped, not copied.
    quantised = [p for name, p in second.named_parameters() if name.endswith("codes")]
    assert quantised and FileMappings().bytes_of(quantised) == sum(
        p.untyped_storage().nbytes() for p in quantised
    )


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_float_checkpoints_quantised_at_load_round_trip(
    tiny_checkpoint, tmp_path, packed_steps, tied, quantize
) -> None:
    """A quantised embedding with its head tied to it (one tensor on disk) or not, int4
    and int8 products, the int8-input layouts of the bf16 products."""
    _, folder = tiny_checkpoint("llama", tie_word_embeddings=tied)
    cache = tmp_path / "cache"
    first, _ = loaded(folder, cache, dtype="bfloat16", quantize=quantize)
    second, phases = loaded(folder, cache, dtype="bfloat16", quantize=quantize)
    assert phases[1].startswith("mapped the repacked weights")
    assert (second.lm_head is None) == (first.lm_head is None)
    if tied:
        assert second.lm_head.codes is second.embed.codes
    for ours, theirs in zip(logits(packed_steps, second), logits(packed_steps, first), strict=True):
        assert torch.equal(ours, theirs)


def _k_quants(name: str) -> str | None:
    """A Q4_K_M-like mix: Q4_K projections, Q6_K for v and for the embedding and head."""
    if "norm" in name or not name.endswith(".weight"):
        return None
    return "Q6_K" if name in ("token_embd.weight", "output.weight") or "attn_v" in name else "Q4_K"


@pytest.mark.parametrize("tied", [True, False])
def test_kept_k_quant_blocks_are_cached_and_mapped_back(
    tiny_checkpoint, tmp_path, packed_steps, tied
) -> None:
    """A K-quant file's kept blocks (a qkv of mixed kinds, the embedding gathered from
    its panels, the head tied to it or not) come back from the entry as they were
    installed, mapped, with the same logits and the same load line."""
    hf_model, _ = tiny_checkpoint(
        "llama", tie_word_embeddings=tied, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, std=0.05,
    )  # fmt: skip
    file = tmp_path / "k.gguf"
    write_gguf(hf_model, file, "llama", kinds=_k_quants)
    cache = tmp_path / "cache"
    first, first_phases = loaded(file, cache, dtype="float32")
    assert any(p.startswith("wrote the repacked weights") for p in first_phases)
    second, phases = loaded(file, cache, dtype="float32")
    assert [p.split(" ")[0] for p in phases] == ["read", "mapped", "prepared"]
    assert phases[-1] == first_phases[-1]  # "... Q4_K in 7 products ... kept as they are"
    assert "kept as they are" in phases[-1]
    assert isinstance(second.embed, kquants.KQuantEmbedding)
    assert second.layers[0].qkv.format == "Q4_K+Q6_K" and second.embed.format == "Q6_K"
    assert second.lm_head is not None and first.lm_head is not None
    assert (first.lm_head.codes is first.embed.codes) == tied
    assert (second.lm_head.codes is second.embed.codes) == tied
    assert weights_cache.describe_modules(second) == weights_cache.describe_modules(first)
    for ours, theirs in zip(logits(packed_steps, second), logits(packed_steps, first), strict=True):
        assert torch.equal(ours, theirs)
    kept = [p for name, p in second.named_parameters() if name.endswith("codes")]
    assert FileMappings().bytes_of(kept) == sum(p.untyped_storage().nbytes() for p in kept)


def test_storages_count_once_whatever_tensors_view_them() -> None:
    storage = torch.zeros(64, dtype=torch.uint8)
    views = [storage, storage[:32], storage.view(8, 8), torch.ones(16, dtype=torch.uint8)]
    assert weights_cache.storage_bytes(views) == 64 + 16


def test_a_changed_file_or_option_never_gets_a_stale_entry(quantised_gguf, tmp_path) -> None:
    cache = tmp_path / "cache"
    loaded(quantised_gguf, cache, dtype="float32")
    (first_entry,) = cache.iterdir()
    # Other options: an entry of their own beside the first.
    _, phases = loaded(quantised_gguf, cache, dtype="bfloat16")
    assert not any(p.startswith("mapped") for p in phases)
    assert len(list(cache.iterdir())) == 2
    # The file rewritten: converted again, and its old entries removed.
    stat = quantised_gguf.stat()
    os.utime(quantised_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _, phases = loaded(quantised_gguf, cache, dtype="float32")
    assert not any(p.startswith("mapped") for p in phases)
    assert not first_entry.exists() and len(list(cache.iterdir())) == 1  # the bf16 one too


def test_a_changed_layout_makes_a_new_entry(quantised_gguf, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    loaded(quantised_gguf, cache, dtype="float32")
    monkeypatch.setattr(weights_cache, "code_digest", lambda: "another layout")
    _, phases = loaded(quantised_gguf, cache, dtype="float32")
    assert not any(p.startswith("mapped") for p in phases)
    assert len(list(cache.iterdir())) == 1  # the old code's entry of this file is gone


def test_a_damaged_entry_is_removed_and_the_model_converted_again(
    quantised_gguf, tmp_path, caplog
) -> None:
    cache = tmp_path / "cache"
    loaded(quantised_gguf, cache, dtype="float32")
    (entry,) = cache.iterdir()
    entry.write_bytes(entry.read_bytes()[:1000])
    _, phases = loaded(quantised_gguf, cache, dtype="float32")
    assert "unreadable" in caplog.text
    assert any(p.startswith("wrote the repacked weights") for p in phases)
    _, phases = loaded(quantised_gguf, cache, dtype="float32")
    assert phases[1].startswith("mapped")


def test_float_models_and_no_cache_folder_write_nothing(tiny_checkpoint, tmp_path) -> None:
    _, folder = tiny_checkpoint("llama")
    cache = tmp_path / "cache"
    loaded(folder, cache, dtype="float32")
    assert not cache.exists() or not list(cache.iterdir())
    loaded(folder, None, dtype="float32", quantize="int8")
    assert not cache.exists() or not list(cache.iterdir())
    assert weights_cache.cache_directory("off") is None
    assert weights_cache.cache_directory(str(tmp_path)) == tmp_path


def test_a_cache_that_cannot_be_written_warns_and_the_load_goes_on(
    quantised_gguf, tmp_path, caplog
) -> None:
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a folder")
    _, phases = loaded(quantised_gguf, in_the_way / "cache", dtype="float32")
    assert "no repacked-weights cache written" in caplog.text
    assert not any(p.startswith("wrote") for p in phases) and phases[-1].startswith("prepared")
    with pytest.raises(InvalidArgumentError, match="weights_cache must be"):
        weights_cache.cache_directory(5)  # type: ignore[arg-type]


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CELLBATCH_CACHE_DIR", str(tmp_path / "a"))
    assert weights_cache.cache_directory("auto") == tmp_path / "a"
    monkeypatch.delenv("CELLBATCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights_cache.cache_directory("auto") == tmp_path / "xdg" / "cellbatch"


def test_weights_that_cannot_fit_are_refused_before_reading(tiny_checkpoint, monkeypatch) -> None:
    _, folder = tiny_checkpoint("llama")
    monkeypatch.setattr(loading, "read_memory", lambda: MemoryInfo(8 * 2**30, 1000))
    with pytest.raises(InvalidArgumentError) as refused:
        load_model(folder, "float32")
    message = str(refused.value)
    for words in ("need at least", "float32", "of 8.00 GiB is available", "--dtype bfloat16"):
        assert words in message, message
    # Quantised, the least size is a quarter of float32's: still refused here, with no
    # bfloat16 advice for a model that is mostly quantised already.
    with pytest.raises(InvalidArgumentError, match="quantised"):
        load_model(folder, "float32", quantize="int4")
