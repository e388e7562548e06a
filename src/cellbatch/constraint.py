"""Constraints compiled to token masks: JSON schemas, any JSON object, regular
expressions, choices and grammars (docs/design.md#structured-generation).

Owns: `ConstraintCompiler` (one per tokenizer: llguidance's view of the vocabulary and a
cache of compiled grammars) and `ConstraintMatcher` (one generation's position in its
grammar); `mask_rows`, which limits logits rows to what their matchers allow.
Promises: `check` refuses a constraint the library rejects with an
InvalidArgumentError that names the problem, before anything runs; a matcher allows
only tokens that keep the text within the constraint, and only the end-of-sequence
token once the constraint is complete, so a constrained generation ends there. A row's
mask depends only on its own matcher: results stay batch-invariant.
Never: samples, or touches a row that has no matcher.

The grammar machinery is llguidance's (Earley parsing over a token trie, masks as
bitmaps of 32 tokens a word).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import torch

from cellbatch.generation_config import Constraint
from cellbatch.types import InvalidArgumentError, Token

# Compiled grammars kept per compiler (a server sees the same few schemas again and again).
MAX_CACHED_GRAMMARS = 256


class MaskSource(Protocol):
    """What `mask_rows` asks for a row's mask."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...


class ConstraintMatcher:
    """One generation's place in its grammar: which tokens may come next."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def consume(self, token: Token) -> bool:
        """Advances past `token`; False when the grammar did not allow it (the mask
        made that impossible, so this means a bug or a token the caller forced)."""
        return bool(self._matcher.consume_token(token))

    def allowed_prefix(self, tokens: Sequence[Token]) -> int:
        """How many leading `tokens` the grammar allows from here, without advancing."""
        return int(self._matcher.validate_tokens(list(tokens))) if tokens else 0

    def rollback(self, count: int) -> None:
        """Takes back the last `count` tokens consumed."""
        if count:
            self._matcher.rollback(count)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed tokens into row `row` of an int32 bitmask [R, words]
        (`new_bitmask`): bit b of word w is token 32 * w + b."""
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer; safe to call from any thread. llguidance's
    view of the vocabulary is built on the first constraint (about a second), so that
    an engine that never sees one never pays for it, nor fails for a tokenizer the
    library cannot read."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token: Token) -> None:
        self.vocab_size = vocab_size
        self.eos_token = eos_token
        self._hf_tokenizer = hf_tokenizer
        self._tokenizer: Any = None
        self._grammars: OrderedDict[Constraint, str] = OrderedDict()
        self._lock = threading.Lock()

    def _vocabulary(self) -> Any:
        """llguidance's tokenizer, built once; InvalidArgumentError when it cannot be."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token
                    )
                except Exception as error:
                    raise InvalidArgumentError(
                        f"this model's tokenizer cannot drive constraints ({error}); "
                        "constrained generation needs a byte-level or sentencepiece "
                        "Hugging Face tokenizer"
                    ) from error
            return self._tokenizer

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, stop_tokens: Collection[Token]
    ) -> ConstraintCompiler | None:
        """The compiler of a `cellbatch.model.tokenizer.Tokenizer` (None without one, or
        without a stop token to end a constrained text with): its end-of-sequence token,
        else its lowest stop token, ends a constraint."""
        if tokenizer is None or not (tokenizer.eos_token_id is not None or stop_tokens):
            return None
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(stop_tokens)
        return cls(tokenizer.backend, vocab_size, eos)

    def check(self, constraint: Constraint) -> None:
        """Compiles `constraint` (kept for later); raises InvalidArgumentError naming what
        the library rejected."""
        self._compiled(constraint)

    def matcher(self, constraint: Constraint) -> ConstraintMatcher:
        import llguidance

        grammar, fresh = self._compiled(constraint)
        # A grammar compiled just now was checked by building a matcher: that one serves.
        matcher = fresh if fresh is not None else llguidance.LLMatcher(self._vocabulary(), grammar)
        return ConstraintMatcher(matcher)

    def _compiled(self, constraint: Constraint) -> tuple[str, Any]:
        """The grammar text, and the matcher built to check it when it was not kept
        already (None when it was)."""
        with self._lock:
            grammar = self._grammars.get(constraint)
            if grammar is not None:
                self._grammars.move_to_end(constraint)
                return grammar, None
        grammar = _compile(constraint)
        import llguidance

        try:
            probe = llguidance.LLMatcher(self._vocabulary(), grammar)
        except Exception as error:  # the library's refusal, raised rather than flagged
            raise InvalidArgumentError(
                f"the {constraint.kind} constraint does not compile: {error}"
            ) from error
        if probe.is_error():
            raise InvalidArgumentError(
                f"the {constraint.kind} constraint does not compile: {probe.get_error()}; "
                "fix it (the grammar library's message above names the part it rejects)"
            )
        with self._lock:
            self._grammars[constraint] = grammar
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar, probe


def _compile(constraint: Constraint) -> str:
    """The llguidance grammar text of `constraint`."""
    import llguidance

    kind = constraint.kind
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(constraint.spec)
            except json.JSONDecodeError as error:
                raise InvalidArgumentError(
                    f"the JSON schema is not valid JSON ({error}); send the schema as an object"
                ) from error
            if not isinstance(schema, dict):
                raise InvalidArgumentError(
                    f"a JSON schema must be an object, got {type(schema).__name__}"
                )
            return str(llguidance.LLMatcher.grammar_from_json_schema(_compact(schema)))
        if kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema(_compact({"type": "object"})))
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(constraint.spec))
        if kind == "choice":
            # Lark string literals take JSON's escapes, so each choice is exactly itself.
            alternatives = " | ".join(json.dumps(choice) for choice in constraint.choices)
            return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
        if constraint.gbnf:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            lark = gbnf_to_lark(constraint.spec)
        else:
            lark = constraint.spec
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    except InvalidArgumentError:
        raise
    except Exception as error:  # the library's own refusal: its message names the part
        raise InvalidArgumentError(f"the {kind} constraint does not compile: {error}") from error


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with JSON's whitespace fixed (", " and ": ", no newlines), as OpenAI's
    structured outputs write it, unless it sets its own `x-guidance` options: with free
    whitespace a model can pad forever and never close the object."""
    if "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def new_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """An int32 bitmask [rows, ceil(vocab / 32)] for `ConstraintMatcher.fill`. (Made
    here: importing llguidance.torch for it costs seconds of torch.compile set-up.)"""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


# Bit b of a bitmask word is token 32 * word + b (llguidance's layout).
_BITS = torch.arange(32, dtype=torch.int32)
# What a disallowed token's logit becomes: the lowest float32, which every sampling path
# treats as probability 0 (a multiply-add writes it 3x faster than masked_fill's -inf).
DISALLOWED = torch.finfo(torch.float32).min


def mask_rows(
    logits: torch.Tensor,
    rows: Sequence[int],
    matchers: Sequence[MaskSource],
    fallback: torch.Tensor | None = None,
) -> torch.Tensor:
    """`logits` [R, V] (float32) with row rows[i] limited to what matchers[i] allows
    (disallowed tokens at DISALLOWED); a new tensor, the input untouched (its raw rows
    give logprobs). The masks are filled in the order given (a verified run's rows ask
    one matcher in turn, advanced draft by draft). Tensor ops over all the rows at
    once: no per-token Python.

    Logits already at -inf (token rules' bans) count as DISALLOWED. A row where nothing
    the matcher allows is left (the rules banned all of it: `min_tokens` holding back the
    stop token of a complete constraint, `allowed_token_ids` outside the grammar) takes
    `fallback`'s row instead, limited the same way: the constraint wins over the rules,
    so the token drawn is always one the constraint allows."""
    vocab = logits.shape[1]
    bitmask = new_bitmask(len(rows), vocab)
    for index, matcher in enumerate(matchers):
        matcher.fill(bitmask, index)
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(rows), -1)[:, :vocab].float()
    allowed = allowed.to(logits.device)  # the logits' device (a GPU's too)
    every_row = len(rows) == logits.shape[0] and list(rows) == list(range(len(rows)))
    picked = None if every_row else torch.tensor(rows, dtype=torch.long, device=logits.device)

    def limit(source: torch.Tensor) -> torch.Tensor:
        """`source`'s constrained rows, masked."""
        chosen = source if picked is None else source.index_select(0, picked)
        # allowed: logit * 1 + 0; disallowed: logit * 0 + DISALLOWED (-inf * 0 would be NaN).
        chosen = chosen.float().clamp_min(DISALLOWED)
        return torch.addcmul((allowed - 1).mul_(-DISALLOWED), chosen, allowed)

    limited = limit(logits)
    if fallback is not None:
        stuck = limited.amax(dim=1) <= DISALLOWED
        if bool(stuck.any()):
            limited = torch.where(stuck[:, None], limit(fallback), limited)
    if picked is None:
        return limited
    masked = logits.float().clone()
    masked[picked] = limited
    return masked
