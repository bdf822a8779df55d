"""``ferryman generate`` (complete prompts, optionally streamed) and ``ferryman chat`` (an
interactive conversation through the model's chat template)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferryman._core import InvalidRequestError
from ferryman.engine_args import EngineArgs, add_cli_args, from_cli
from ferryman.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from ferryman.engine import Engine


def register(sub: Any) -> None:
    g = sub.add_parser("generate", help="complete prompts and print the text")
    g.add_argument("prompt", nargs="+", help="one or more prompts")
    add_cli_args(g.add_argument_group("engine"), EngineArgs)
    _add_sampling_args(g, 64)
    g.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt at a time)")
    g.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user message through the model's chat template (as LLM.chat); "
        "an instruct model given a raw prompt may end at once",
    )
    g.set_defaults(run=run_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    add_cli_args(c.add_argument_group("engine"), EngineArgs)
    _add_sampling_args(c, 256)
    c.add_argument("--system", default=None, help="a system message")
    c.set_defaults(run=run_chat)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default: {max_tokens})"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens (default: -1, off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob (default: 0)")
    g.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default: 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default: 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 is off (default: 1)")
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS / stop id before this many tokens")
    so = g.add_mutually_exclusive_group()  # structured outputs (docs/structured-outputs.md)
    so.add_argument(
        "--json-schema", default=None, help="the output follows this JSON schema (JSON, or @file)"
    )
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", default=None, help="the output matches this regular expression")
    so.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    so.add_argument("--grammar", default=None, help="the output follows this Lark grammar (text, or @file)")


def _text_or_file(v: str) -> str:
    return Path(v[1:]).read_text() if v.startswith("@") else v


def _structured(a: argparse.Namespace) -> StructuredOutputsParams | None:
    if a.json_schema is not None:
        return StructuredOutputsParams(json=_text_or_file(a.json_schema))
    if a.grammar is not None:
        return StructuredOutputsParams(grammar=_text_or_file(a.grammar))
    if a.regex is not None or a.choice is not None:
        return StructuredOutputsParams(regex=a.regex, choice=a.choice)
    return StructuredOutputsParams(json_object=True) if a.json_object else None


def _sampling(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.request_seed,
        max_tokens=a.max_tokens,
        stop=a.stop,
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty,
        repetition_penalty=a.repetition_penalty,
        min_tokens=a.min_tokens,
        structured_outputs=_structured(a),
    )


def _engine(a: argparse.Namespace) -> Engine:
    from ferryman.engine import Engine

    return Engine.from_engine_args(from_cli(EngineArgs, a))


def run_generate(a: argparse.Namespace) -> int:
    engine = _engine(a)
    params = _sampling(a)
    prompts: list[str | list[int]] = list(a.prompt)
    if a.chat:
        tok = engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            print("--chat: this model has no chat template", file=sys.stderr)
            return 2
        msgs = [[{"role": "user", "content": p}] for p in a.prompt]
        prompts = [engine.render_chat(m)[1] for m in msgs]  # as Engine.chat sends them
    if a.stream:
        for shown, prompt in zip(a.prompt, prompts, strict=True):
            deltas = stream(engine, prompt, params)  # a refused prompt is said before it is echoed
            sys.stdout.write("" if a.chat else shown)
            for delta in deltas:
                sys.stdout.write(delta)
                sys.stdout.flush()
            sys.stdout.write("\n")
        return 0
    for shown, out in zip(a.prompt, engine.generate(prompts, params), strict=True):
        o = out.outputs[0]
        sys.stdout.write((o.text if a.chat else shown + o.text) + "\n")
        if not o.token_ids or (o.finish_reason == "stop" and not o.text.strip()):
            hint = "" if a.chat else "; an instruct model may need --chat"
            print(
                f"ferryman: empty output for {shown!r} (finish_reason {o.finish_reason}){hint}",
                file=sys.stderr,
            )
    return 0


def stream(engine: Engine, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Yields the text of one request as the engine steps (the core holds back a possible stop
    string until it is decided). As ``generate`` does, a ``max_tokens`` past ``max_model_len``
    is cut to the room the prompt leaves; a request left unfinished (Ctrl-C) is aborted. The
    request is added (or refused) on the call, before the first delta is asked for."""
    _, ids = engine.tokenize(prompt, cut=params.truncate_prompt_tokens is not None)
    params = dataclasses.replace(engine._fit(params, ids), output_kind="delta")
    engine.add_request("cli", prompt, params, prompt_token_ids=ids)
    return _deltas(engine)


def _deltas(engine: Engine) -> Iterator[str]:
    try:
        while engine.has_unfinished_requests():
            for ro in engine.step().outputs:
                if ro.outputs and ro.outputs[0].text:
                    yield ro.outputs[0].text
                if ro.finished:
                    return
    finally:
        engine.abort_request("cli")  # False once it finished


def run_chat(a: argparse.Namespace) -> int:
    engine = _engine(a)
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        print("this model has no chat template", file=sys.stderr)
        return 2
    history: list[dict[str, str]] = [{"role": "system", "content": a.system}] if a.system else []
    params = _sampling(a)
    if params.structured_outputs is not None:  # a grammar that cannot compile is said now, once
        engine.add_request("cli-check", [0], dataclasses.replace(params, max_tokens=1, min_tokens=0))
        engine.abort_request("cli-check")
    print("ferryman chat: an empty line or Ctrl-D quits, /reset forgets the conversation", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        history.append({"role": "user", "content": line})
        reply = []
        try:
            for delta in stream(engine, engine.render_chat(history)[1], params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except InvalidRequestError as e:  # this turn only (a conversation past max_model_len)
            history.pop()
            print(f"ferryman chat: {e} (/reset starts over)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0
