"""``ChatTokenizer``: a ``tokenizer.json`` run by the ``tokenizers`` package, with its named special
tokens and chat template; the part of a transformers tokenizer that ferryman uses (``encode``,
``decode``, ``convert_ids_to_tokens``, ``apply_chat_template`` with ``tokenize=False`` or ids,
``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` and their ids, ``chat_template``,
``backend_tokenizer``, ``save_pretrained``) without importing transformers, which costs about a
second of start-up.

``load_saved`` reads a folder that transformers' ``save_pretrained`` wrote (the GGUF conversion
cache holds one). A ``TokenizersBackend`` / ``PreTrainedTokenizerFast`` folder loads in
transformers as its ``tokenizer.json`` stands (the file already holds the post-processor, so BOS
and EOS handling, and every added token), so a ``ChatTokenizer`` of it gives the same ids, text and
chat prompts (tests/python/test_tokenizer.py compares the two). Any other class, or a config that
asks for more (``split_special_tokens``, ``clean_up_tokenization_spaces``), loads through
transformers as before.
"""

from __future__ import annotations

import json
import operator
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from ferryman._core import InvalidRequestError
from ferryman.chat_template import render

PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TEMPLATE_DIR = "additional_chat_templates"


class ChatTokenizer:
    """One tokenizer: ``backend`` does the tokenization, ``special`` names the special tokens
    (``{"eos_token": "<|im_end|>", ...}``), ``template`` is the chat template (one text, or named
    texts with a ``"default"``), ``folder`` the files it came from, if any."""

    def __init__(
        self,
        backend: Tokenizer,
        special: dict[str, str],
        template: str | dict[str, str] | None,
        tokenizer_class: str = "ChatTokenizer",
        folder: Path | None = None,
    ) -> None:
        self.backend_tokenizer = backend
        self.special_tokens_map = {k: special[k] for k in SPECIAL_NAMES if k in special}
        self.chat_template = template
        self.tokenizer_class = tokenizer_class
        self.folder = folder

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTokenizer:
        """From a folder transformers saved; ``ValueError`` naming what is missing or unreadable."""
        root = Path(folder)
        config = read_config(root)
        try:
            backend = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # the tokenizers package raises its own Exception for a bad file
            raise ValueError(
                f"{root / 'tokenizer.json'}: not a tokenizer the tokenizers package reads: {e}"
            ) from e
        special = {k: t for k in SPECIAL_NAMES if (t := _token_text(config.get(k))) is not None}
        cls_name = str(config.get("tokenizer_class") or "ChatTokenizer")
        return cls(backend, special, read_template(root, config), cls_name, root)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens_map.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor (a
        BOS or EOS where its file asks for one). Runs without the GIL (``encode_batch`` releases it,
        a single ``encode`` does not), so a long prompt tokenized on one thread does not stall the
        others. Callers with text from outside check it first (``check_text``)."""
        return list(self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        seq = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        return str(self.backend_tokenizer.decode(seq, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> Any:
        """A token's string (``None`` for an id outside the vocabulary), or a list of them."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def apply_chat_template(
        self,
        conversation: list[Any],
        tools: list[Any] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """One conversation through the chat template (``chat_template``: a template text or the
        name of one of the tokenizer's), as text, or its ids (encoded without special tokens)
        with ``tokenize``. No template is a ``ValueError``."""
        template = self._template(chat_template, tools)
        text = render(template, conversation, tools, add_generation_prompt, self.special_tokens_map, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, given: str | None, tools: list[Any] | None) -> str:
        """``given`` (a name of one of several templates, else a template text), or the default
        (with several: ``"tool_use"`` when tools are given and it exists, else ``"default"``)."""
        t = self.chat_template
        if isinstance(t, dict) and given is not None:
            return t.get(given, given)
        if isinstance(t, dict):
            key = "tool_use" if tools is not None and "tool_use" in t else "default"
            if key not in t:
                raise ValueError(f"this tokenizer has several chat templates and no default: {sorted(t)}")
            return t[key]
        if given is not None:
            return given
        if t is None:
            raise ValueError("this tokenizer has no chat template")
        return t

    def save_pretrained(self, directory: str | Path) -> None:
        """Writes the tokenizer as transformers saves it (the files it was read from)."""
        if self.folder is None:
            raise ValueError("this tokenizer was not read from a folder")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        for name in (*FILES, TEMPLATE_DIR):
            src = self.folder / name
            if src.is_dir():
                shutil.copytree(src, out / name, dirs_exist_ok=True)
            elif src.is_file():
                shutil.copyfile(src, out / name)


def check_text(text: Any, what: str = "prompt") -> None:
    """``InvalidRequestError`` (a ``ValueError``) unless ``text`` is a string of valid Unicode (JSON
    can carry a lone surrogate, ``"\\ud800"``, which no encoding represents)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        msg = f"{what} is not valid Unicode text: {e.reason} at character {e.start}"
        raise InvalidRequestError(msg) from None


# steps that may delete text (then a short prompt may hold many characters, and there is no bound)
_DELETES = ("Strip", "StripAccents", "BertNormalizer", "BertPreTokenizer", "Whitespace", "WhitespaceSplit",
            "CharDelimiterSplit", "Precompiled", "Removed")  # fmt: skip


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a prompt of ``max_model_len`` tokens can spell (a text past it is refused
    untokenized): a token spells at most its longest vocabulary entry (a byte-level entry's bytes,
    never fewer than the characters they decode to), x4 for what normalization folds into one
    character (NFC composes up to three). No bound (2**62) without a tokenizer, or where its steps
    may delete text or unknown characters fuse into one token (none in the Llama family)."""
    if tokenizer is None:
        return 1 << 62
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    steps, model = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")]), spec.get("model") or {}
    if any(f'"{d}"' in steps for d in _DELETES) or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return 1 << 62
    longest = max(map(len, tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max_model_len * longest * 4


def prompt_ids(
    tokenizer: Any, vocab_size: int, prompt: str | Iterable[int], add_special_tokens: bool = True
) -> tuple[str | None, list[int]]:
    """A prompt's text (None for token ids) and ids: text through ``tokenizer``, with its special
    tokens (a BOS where its post-processor adds one, as vLLM and transformers encode a prompt)
    unless ``add_special_tokens`` is false (a rendered chat, whose template has its own); ids
    checked against the vocabulary. ``InvalidRequestError`` for text without a tokenizer, text
    that is not valid Unicode, or ids outside the vocabulary."""
    prompt = plain_prompt(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass prompts as token-id lists")
        check_text(prompt)
        return prompt, list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Iterable):
        raise InvalidRequestError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")
    ids = [t if type(t) is int else _token_id(t) for t in prompt]
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} out of range [0, {vocab_size})")
    return None, ids


def _token_id(t: Any) -> int:
    """A token id given as another integer type (numpy's); a float, a bool or text is refused,
    not truncated or read as a number."""
    try:
        if isinstance(t, bool):
            raise TypeError
        return operator.index(t)
    except TypeError:
        raise InvalidRequestError(f"token ids must be integers, got {type(t).__name__} {t!r}") from None


def plain_prompt(p: Any) -> Any:
    """A prompt as ``prompt_ids`` reads it: text or ids; vLLM's prompt dicts are unwrapped (ids
    first when both are given), and a dict with anything else is refused by name."""
    if not isinstance(p, dict):
        return p
    extra = sorted(set(p) - {"prompt", "prompt_token_ids"})
    if extra:
        raise InvalidRequestError(
            f"prompt dict keys {extra} are not supported (only prompt, prompt_token_ids)"
        )
    if "prompt_token_ids" in p:
        return p["prompt_token_ids"]
    if "prompt" in p:
        return p["prompt"]
    raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an added token's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_config(root: Path) -> dict[str, Any]:
    file = root / "tokenizer_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read the tokenizer's config: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object")
    return config


def read_template(root: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template as transformers reads it: ``chat_template.jinja`` and the named ones in
    ``additional_chat_templates/`` (which win), else ``chat_template`` in the config (a text, or
    a list of ``{"name", "template"}``)."""
    named: dict[str, str] = {}
    if (root / "chat_template.jinja").is_file():
        named["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    if (root / TEMPLATE_DIR).is_dir():
        for f in sorted((root / TEMPLATE_DIR).glob("*.jinja")):
            named[f.stem] = f.read_text(encoding="utf-8")
    if named:
        return named["default"] if list(named) == ["default"] else named
    given = config.get("chat_template")
    if isinstance(given, list):
        return {str(t["name"]): str(t["template"]) for t in given}
    return given if isinstance(given, str) else None


def plain_folder(root: Path) -> bool:
    """Whether ``root`` holds a tokenizer that a ``ChatTokenizer`` reads as transformers would."""
    if not (root / "tokenizer.json").is_file() or not (root / "tokenizer_config.json").is_file():
        return False
    config = read_config(root)
    asks_more = config.get("split_special_tokens") or config.get("clean_up_tokenization_spaces")
    return config.get("tokenizer_class") in PLAIN_CLASSES and not asks_more


def load_saved(folder: str | Path) -> Any:
    """A ``ChatTokenizer`` for a plain folder (``plain_folder``), else transformers' tokenizer."""
    root = Path(folder)
    if plain_folder(root):
        return ChatTokenizer.from_folder(root)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))
