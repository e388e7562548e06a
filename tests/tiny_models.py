"""Tiny random Llama-family checkpoints for tests, and transformers' greedy reference.

`make_tiny_checkpoint(kind, folder)` writes a Hugging Face folder (config.json +
safetensors, no tokenizer) whose every parameter is redrawn: biases non-zero and norm
weights away from 1, so that each part of the computation shows in the logits.
`reference_model(folder)` loads transformers' model back from that folder (a freshly
built in-memory model has been seen to differ from the saved one); `greedy_reference`
runs its greedy `generate` one prompt at a time and keeps the logits, so that a
mismatch can be told apart from a near-tie (`first_divergence`); `greedy_check` finds
the same tokens, as far as they agree with ours, in one teacher-forced forward pass.
`write_gguf` writes a transformers model as a GGUF file, with tensors quantised by gguf
where asked. `default_tokenizer()` is transformers' tokenizer of the embedded default
model, read from its GGUF file once per process (the read takes seconds).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cellbatch.types import ModelGeometry

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
KINDS = ("llama", "qwen2", "qwen3", "mistral")


def head_geometry(num_heads: int, num_kv_heads: int, head_dim: int) -> ModelGeometry:
    """A one-layer geometry with these attention heads, for tests of the attention op
    alone (the other sizes are never read there)."""
    return ModelGeometry(
        vocab_size=16,
        max_positions=1024,
        num_layers=1,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=num_heads * head_dim,
        layer_windows=(None,),
        eos_token_ids=(),
    )


def tiny_config(kind: str, **overrides: object):  # -> transformers.PretrainedConfig
    """transformers config of a tiny `kind` model ("llama", "qwen2", "qwen3", "mistral")."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }
    settings = {**TINY, **overrides}
    if kind in ("qwen3", "mistral"):
        settings.setdefault("head_dim", 16)
    return classes[kind](**settings)


def make_tiny_checkpoint(
    kind: str,
    folder: Path,
    *,
    seed: int = 0,
    std: float = 0.15,
    max_shard_size: str | None = None,
    **overrides: object,
):  # -> tuple[transformers.PreTrainedModel, Path]
    """Builds a tiny random `kind` model, saves it to `folder`, returns (model, folder).

    Weights are drawn from N(0, std) (norm weights from U(0.5, 1.5)) with `seed`.
    """
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, std)
    model.eval()
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **extra)
    return model, folder


@functools.cache
def default_tokenizer():  # -> transformers.PreTrainedTokenizerBase
    """transformers' tokenizer of the embedded default model's GGUF file, read once per
    process. Shared: callers only read it (a caller that adds tokens changes a deepcopy)."""
    import transformers

    from cellbatch.model.default import default_model_path

    gguf = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def make_tiny_chat_checkpoint(folder: Path, context: int = 256) -> Path:
    """A tiny random Llama carrying the default model's tokenizer and chat template
    (vocabulary, EOS and all) in `folder`, for tests that need text and chat."""
    tokenizer = default_tokenizer()
    make_tiny_checkpoint(
        "llama",
        folder,
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    tokenizer.save_pretrained(folder)
    return folder


# A ChatML template that thinks as Qwen3's does: the model opens <think> itself, and
# `enable_thinking=False` closes an empty one in the prompt.
THINKING_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "(message['content'] or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def make_scripted_thinking_checkpoint(folder: Path, script: str, context: int = 256) -> Path:
    """A tiny Llama with the default model's tokenizer (plus Qwen3's `<think>` and
    `</think>` as added tokens) and `THINKING_TEMPLATE`, whose greedy answer to any chat
    prompt is `script`, then EOS. Its layers add nothing to the residual stream (zero
    output projections), so each token's logits depend on that token alone: the
    generation prompt's last token leads to the script's first, each script token to
    the next (the script's tokens must differ from each other)."""
    tokenizer = copy.deepcopy(default_tokenizer())  # changed below: the shared one is not
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    chain = [
        tokenizer.encode(prompt, add_special_tokens=False)[-1],
        *tokenizer.encode(script, add_special_tokens=False),
    ]
    assert len(set(chain)) == len(chain), f"the script's tokens repeat: {chain}"
    hidden = 64
    assert len(chain) <= hidden, "the script is too long for the model's width"
    model, _ = make_tiny_checkpoint(
        "llama",
        folder,
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for position, token in enumerate(chain):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, position] = 1.0
            following = chain[position + 1] if position + 1 < len(chain) else None
            model.lm_head.weight[following or tokenizer.eos_token_id, position] = 10.0
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def reference_model(folder: Path, **options: object):  # -> transformers.PreTrainedModel
    """transformers' fp32 model loaded from `folder` (options go to from_pretrained)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **options
    )
    return model.eval()


@dataclass
class Reference:
    """transformers' greedy continuation of one prompt, with the raw logits of each step."""

    tokens: list[int]
    logits: torch.Tensor  # [len(tokens), vocab] float32


def greedy_reference(
    model, prompt: Sequence[int], max_new_tokens: int, stop_tokens: Sequence[int] = ()
) -> Reference:
    """Greedy `generate` on one prompt; stops at `stop_tokens` (none: never stops early)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=list(stop_tokens) or None,
            pad_token_id=next(iter(stop_tokens), 0),
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Reference(tokens, torch.cat(out.logits).float())


def greedy_check(
    model,
    prompt: Sequence[int],
    ours: Sequence[int],
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
) -> Reference:
    """transformers' greedy continuation of `prompt`, as far as it agrees with `ours`,
    from one forward pass over prompt + ours (teacher forcing) rather than `generate`'s
    one pass per token: greedy picks each token as the argmax given the tokens before it,
    so where ours holds the argmax at every step, transformers' greedy `generate` gives
    ours. The reference follows ours up to the first step whose argmax differs (taking
    the argmax there and stopping), stops after a stop token or `max_new_tokens`, and
    where ours ends early, without a stop token, goes on by one argmax token: compared
    with ours, as `greedy_reference`'s tokens would be (`first_divergence`, `near_tie`)."""
    ids = torch.tensor([[*prompt, *ours]])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    steps = logits[len(prompt) - 1 :]  # steps[i]: the logits that choose new token i
    stops = set(stop_tokens)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens and len(tokens) < steps.shape[0]:
        token = int(steps[len(tokens)].argmax())
        tokens.append(token)
        if token in stops or len(tokens) > len(ours) or token != ours[len(tokens) - 1]:
            break
    return Reference(tokens, steps[: len(tokens)].clone())


def divergence_index(ours: Sequence[int], reference: Reference) -> int | None:
    """The first index where the tokens differ (or the shorter length); None when equal."""
    ours, theirs = list(ours), reference.tokens
    if ours == theirs:
        return None
    common = min(len(ours), len(theirs))
    return next((i for i in range(common) if ours[i] != theirs[i]), common)


def first_divergence(ours: Sequence[int], reference: Reference) -> str:
    """ "" when equal; else where and how the tokens differ, with transformers' top-2 logits
    at that step (a near-tie there points at rounding rather than a bug)."""
    at = divergence_index(ours, reference)
    if at is None:
        return ""
    detail = f"first difference at new token {at}: ours {list(ours)[at : at + 3]}, "
    detail += f"transformers {reference.tokens[at : at + 3]}"
    if at < reference.logits.shape[0]:
        top = reference.logits[at].topk(2)
        detail += (
            f"; transformers' top-2 there: {top.indices.tolist()} with logits "
            f"{[round(v, 5) for v in top.values.tolist()]} (gap "
            f"{(top.values[0] - top.values[1]).item():.5f})"
        )
    return detail


def near_tie(ours: Sequence[int], reference: Reference, tolerance: float = 0.01) -> bool:
    """True when the tokens first differ at a step where transformers' top-2 logits differ
    by less than `tolerance` and our token is one of those two (a length mismatch with an
    equal common part is never a tie)."""
    at = divergence_index(ours, reference)
    if at is None or at >= min(len(ours), len(reference.tokens)):
        return False
    top = reference.logits[at].topk(2)
    gap = (top.values[0] - top.values[1]).item()
    return gap < tolerance and list(ours)[at] in top.indices.tolist()


def write_gguf(
    hf_model,
    path: Path,
    arch: str,
    name: str = "tiny",
    kinds: Callable[[str], str | None] | None = None,
) -> None:
    """A GGUF laid out the way llama.cpp's converter writes it (llama arch: Q/K rows of
        each head interleaved). Tensors are float32, except where `kinds(gguf name)` names a
        kind that gguf can quantise ("Q4_1", "Q8_0", ...) or that `K_QUANT_ENCODERS` encodes
    ("Q4_K", "Q5_K", "Q6_K"). A model with tied embeddings has no output tensor, as the
    converter writes it."""
    import gguf
    import numpy as np

    c = hf_model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        return (
            w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    renames = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for key, value in hf_model.state_dict().items():
        array = value.detach().float().numpy().copy()
        if key == "model.embed_tokens.weight":
            target = "token_embd.weight"
        elif key == "model.norm.weight":
            target = "output_norm.weight"
        elif key == "lm_head.weight":
            if hf_model.config.tie_word_embeddings:
                continue
            target = "output.weight"
        else:
            layer, rest = key.removeprefix("model.layers.").split(".", 1)
            module, suffix = rest.rsplit(".", 1)
            target = f"blk.{layer}.{renames[module]}.{suffix}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = permute(array, c.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = permute(array, c.num_key_value_heads)
        kind = kinds(target) if kinds is not None else None
        if kind is None:
            writer.add_tensor(target, array)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            if kind in K_QUANT_ENCODERS:
                blocks = K_QUANT_ENCODERS[kind](array)
            else:
                blocks = gguf.quants.quantize(array, qtype)
            writer.add_tensor(target, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- K-quant blocks (gguf's Python cannot quantise to them) ----------------------------------
# Round-to-nearest encoders, simpler than llama.cpp's (no search for the best scales), that
# write well-formed blocks: what a test needs is a file whose tensors are K-quant blocks
# close to the model's own weights.


def _f16(values):  # -> float16 values of a float32 array, and them as float32
    import numpy as np

    half = values.astype(np.float16)
    return half, half.astype(np.float32)


def _q45_k_blocks(weight, levels: int):  # -> uint8 [rows, blocks * bytes] of Q4_K or Q5_K
    import numpy as np

    rows = weight.shape[0]
    w = weight.astype(np.float32).reshape(rows, -1, 8, 32)  # [rows, blocks, sub, 32]
    low = np.minimum(w.min(-1), 0.0)
    step = np.maximum(w.max(-1) - low, 1e-12) / levels
    d_half, d = _f16(step.max(-1) / 63)
    dmin_half, dmin = _f16(np.maximum((-low).max(-1) / 63, 1e-12))
    sc = np.clip(np.round(step / np.maximum(d[..., None], 1e-12)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / dmin[..., None]), 0, 63).astype(np.uint8)
    scale = d[..., None] * sc
    q = np.clip(np.round((w + (dmin[..., None] * mn)[..., None]) / scale[..., None]), 0, levels)
    q = q.astype(np.uint8)
    packed = np.empty((*sc.shape[:-1], 12), np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    pairs = q.reshape(*q.shape[:2], 4, 2, 32) & 15  # sub-blocks 2j (low) and 2j + 1 (high)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)
    parts = [d_half[..., None].view(np.uint8), dmin_half[..., None].view(np.uint8), packed]
    if levels == 31:
        bits = (q >> 4) & 1  # [rows, blocks, sub, 32]: bit `sub` of byte l
        parts.append((bits << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=2, dtype=np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def q4_k_blocks(weight):
    """Q4_K blocks of a float [rows, K] weight (K a multiple of 256)."""
    return _q45_k_blocks(weight, 15)


def q5_k_blocks(weight):
    """Q5_K blocks of a float [rows, K] weight (K a multiple of 256)."""
    return _q45_k_blocks(weight, 31)


def q6_k_blocks(weight):
    """Q6_K blocks of a float [rows, K] weight (K a multiple of 256)."""
    import numpy as np

    rows = weight.shape[0]
    w = weight.astype(np.float32).reshape(rows, -1, 16, 16)  # [rows, blocks, sub, 16]
    step = np.maximum(np.abs(w).max(-1), 1e-12) / 31
    d_half, d = _f16(step.max(-1) / 127)
    sc = np.clip(np.round(step / np.maximum(d[..., None], 1e-12)), 1, 127).astype(np.int8)
    scale = d[..., None] * sc
    q = np.clip(np.round(w / scale[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(rows, -1, 2, 4, 32)  # [rows, blocks, half of 128, quarter, 32]
    ql = (q[..., :2, :] & 15) | ((q[..., 2:, :] & 15) << 4)  # quarters (0, 2) and (1, 3)
    qh = sum((q[..., k, :] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)
    parts = [
        ql.reshape(rows, -1, 128),
        qh.reshape(rows, -1, 64),
        sc.view(np.uint8),
        d_half[..., None].view(np.uint8),
    ]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


K_QUANT_ENCODERS = {"Q4_K": q4_k_blocks, "Q5_K": q5_k_blocks, "Q6_K": q6_k_blocks}
