"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults), and
StructuredOutputsParams: the grammar a request's output must follow."""

from __future__ import annotations

import copy
import json
import operator
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from ferryman._core import InvalidRequestError
from ferryman.gbnf import to_lark

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# integer fields, and what the core and the sampling table store them in (int32 or int64)
_I32, _I64 = (-(2**31), 2**31), (-(2**63), 2**63)
_INTS = {"n": _I32, "top_k": _I64, "priority": _I32, "min_tokens": _I64}
_OPTIONAL_INTS = {
    "seed": _I64,
    "max_tokens": _I64,
    "logprobs": _I32,
    "prompt_logprobs": _I32,
    "truncate_prompt_tokens": _I64,
}
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _check_types(p: SamplingParams) -> None:
    """Every field of the type it must have (an integer-like value becomes an ``int``, a real
    number a ``float``), integers within what the core and the sampler store: ``ValueError``
    naming the field otherwise, so that a request is refused before anything of it is queued."""
    for name, (lo, hi) in (_INTS | _OPTIONAL_INTS).items():
        v = getattr(p, name)
        if v is None and name in _OPTIONAL_INTS:
            continue
        try:
            v = operator.index(v)
        except TypeError:
            raise ValueError(f"{name} must be an integer, got {v!r}") from None
        if not lo <= v < hi:
            raise ValueError(f"{name} must be in [{lo}, {hi}), got {v}")
        setattr(p, name, v)
    for name in _FLOATS:
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, Real):
            raise ValueError(f"{name} must be a number, got {v!r}")
        setattr(p, name, float(v))
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if not isinstance(getattr(p, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(p, name)!r}")
    if not all(isinstance(s, str) for s in p.stop):
        raise ValueError(f"stop must be a string or a list of strings, got {p.stop!r}")
    try:
        p.stop_token_ids = [operator.index(t) for t in p.stop_token_ids]
    except TypeError:
        raise ValueError(f"stop_token_ids must be token ids, got {p.stop_token_ids!r}") from None
    if any(not 0 <= t < 2**31 for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids: token ids must be in [0, 2**31), got {p.stop_token_ids}")
    if p.allowed_token_ids is not None:
        try:
            p.allowed_token_ids = [operator.index(t) for t in p.allowed_token_ids]
        except TypeError:
            raise ValueError(f"allowed_token_ids must be token ids, got {p.allowed_token_ids!r}") from None
        if not p.allowed_token_ids or any(t < 0 for t in p.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be non-empty, ids >= 0, got {p.allowed_token_ids}")
    words = [] if p.bad_words is None else p.bad_words
    if not isinstance(words, list | tuple) or not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"bad_words must be a list of words (not blank), got {p.bad_words!r}")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its text), ``json_object`` (any
    JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (a Lark grammar,
    llguidance's dialect, or a GBNF one: ``gbnf.py``). vLLM's names. Masks come from the
    llguidance crate in the core; JSON is generated compact (no whitespace between tokens)
    unless the schema's ``x-guidance`` options say otherwise."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured outputs: give exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured outputs: choice must be a non-empty list of strings")

    def spec(self) -> tuple[str, str]:
        """(kind, data) as the core's ``RequestParams`` takes them."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "lark", to_lark(self.grammar)  # a GBNF grammar is rewritten, a Lark one kept
        return "json_object", ""


GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
MAX_TEMPERATURE = 1e6  # above, the float32 logits it divides are all but equal anyway


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping.

    ``temperature=0`` is greedy, and so is any temperature below ``GREEDY_BELOW`` (1e-5, vLLM's
    rule: dividing by it would overflow the logits). ``top_k=-1`` (or 0) and ``top_p=1`` and
    ``min_p=0`` disable those filters. ``seed`` makes a request's samples reproducible
    regardless of the batch it runs in.

    Before any filter (greedy included), in this order, as vLLM applies them:
    ``allowed_token_ids`` (no other token is sampled), ``bad_words``, ``min_tokens``
    (the EOS ids and ``stop_token_ids`` cannot be sampled before that many output tokens, and
    ``stop`` strings are looked for only after them),
    ``logit_bias`` (``{token_id: bias}`` added to the logits), then the penalties over each
    sequence's own tokens: ``repetition_penalty`` (vLLM's: a logit of a token in the prompt or the
    output so far is divided by it if positive, multiplied if not), ``frequency_penalty`` (minus
    it times the token's count in the output) and ``presence_penalty`` (minus it once the token
    is in the output). Logprobs stay those of the model's raw logits (with a structured output,
    of those its grammar allows, as vLLM reports them).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never sampled (``worker/logit_masks.py``): a word's last token is barred
    # wherever the output so far ends with its other tokens
    bad_words: list[str] | None = None
    min_tokens: int = 0
    # the logprob of each prompt token (the first is None) and the top N at each position;
    # such a request takes no prefix-cache hits. With it, max_tokens may be 0 (no output)
    prompt_logprobs: int | None = None
    # "cumulative": each step's output holds the whole text so far (vLLM's LLMEngine default);
    # "delta": only what is new since the last output; "final_only": one output, when finished
    output_kind: str = "cumulative"
    # the output follows this grammar (JSON schema, regex, choice, Lark); see StructuredOutputsParams
    structured_outputs: StructuredOutputsParams | None = None
    # a matched stop string stays at the end of the text (vLLM's); by default the text ends before it
    include_stop_str_in_output: bool = False
    # vLLM's: only the last k prompt tokens are kept; -1: as many as leave room for max_tokens
    # (max_model_len - 1 when max_tokens leaves none; vLLM keeps max_model_len)
    truncate_prompt_tokens: int | None = None
    # vLLM's text options: only their defaults are served (special tokens never reach the text)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, got {so!r}")
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if getattr(self, name) is not True:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported (only True)")
        self.stop, self.stop_token_ids = self.stop or [], self.stop_token_ids or []
        _check_types(self)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be >= 1 (0 only with prompt_logprobs), got {self.max_tokens}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1 (to fit), got {k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        # bounded so a penalized logit stays finite in float32 (100 / 1e-3, -100 * 1e3)
        if not 1e-3 <= self.repetition_penalty <= 1e3:
            raise ValueError(f"repetition_penalty must be in [0.001, 1000], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logit_bias:
            bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            bad = next(((t, b) for t, b in bias.items() if t < 0 or not -100 <= b <= 100), None)
            if bad is not None:
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {bad}")
            self.logit_bias = bias

    def check_engine(self, vocab_size: int, max_logprobs: int, policy: str) -> None:
        """``InvalidRequestError`` unless the engine can serve these: logit-bias ids within its
        vocabulary, at most ``max_logprobs`` logprobs (and prompt logprobs) per token, and a
        ``priority`` other than 0 only under the priority policy (vLLM's rule: fcfs would
        silently ignore it)."""
        if self.priority != 0 and policy != "priority":
            raise InvalidRequestError(
                f"priority {self.priority} needs the priority scheduling policy (policy='priority'); "
                f"this engine's policy is {policy!r}"
            )
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids)):
            bad = next((t for t in ids or () if t >= vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"{name}: token id {bad} out of range [0, {vocab_size})")
        most = min(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > most:
                raise InvalidRequestError(f"{name} must be at most {most} (max_logprobs), got {v}")

    def truncated(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` keeps it: its last k tokens; -1: the last
        ``max_model_len - max_tokens``, or ``max_model_len - 1`` when that leaves no prompt (an
        open or too large ``max_tokens``: the output then gets what room is left)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        if k == -1:
            room = max_model_len - (self.max_tokens or max_model_len)
            k = room if room >= 1 else max(1, max_model_len - 1)
        return prompt_token_ids[-k:]

    def clone(self) -> SamplingParams:
        """vLLM's: a copy whose lists and dicts are its own (``stop``, ``logit_bias``, ...). Made
        field by field: ``add_request`` clones every request, and a deep copy costs ~17 us."""
        c = copy.copy(self)
        c.stop, c.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        c.logit_bias = None if self.logit_bias is None else dict(self.logit_bias)
        c.allowed_token_ids = None if self.allowed_token_ids is None else list(self.allowed_token_ids)
        c.bad_words = None if self.bad_words is None else list(self.bad_words)
        try:
            c.structured_outputs = copy.deepcopy(self.structured_outputs)
        except RecursionError:
            raise ValueError("structured_outputs: the schema nests too deeply") from None
        return c

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (they need each sequence's token counts on the device)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
