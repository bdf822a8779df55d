"""Fuzzing the OpenAI-compatible server with schemathesis against its own ``/openapi.json``: every
operation, in process over ASGI (the app's lifespan runs, so the engine thread serves), a tiny
random Llama on CPU behind it, metrics on as ``ferryman serve`` has them. Each operation gets
schemathesis' examples, boundary ("coverage") and random ("fuzzing") cases, valid and invalid,
bounded and derandomized. The checks:

- no input gets a 5xx;
- the schema and the server agree: a body the schema allows is served (or 404 for a model name
  other than the served one), a body it forbids gets 400. Only what depends on the model, which no
  static schema can say (prompt plus ``max_tokens`` beyond ``max_model_len``, a token id beyond
  its vocabulary), may refuse an allowed body: 400 with the engine's message;
- responses match the schema where it declares them;
- every error carries OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

Generation stays cheap without bending the inputs: ``max_model_len`` is small (the engine refuses
anything longer, 400) and the KV pool holds ``max_num_seqs`` full sequences (any ``n`` <= 128
fits), so a request is at most a few dozen steps of a tiny model."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis import Case, CheckContext, Response
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)
from tiny_models import build

from ferryman.engine import Engine
from ferryman.server.app import build_app
from ferryman.server.async_engine import AsyncEngine
from ferryman.server.metrics import Metrics

NAME = "tiny"
MAX_MODEL_LEN, MAX_NUM_SEQS, BLOCK_SIZE = 64, 256, 4

# Built at import: schemathesis' pytest integration collects one test per operation from a schema
# it has at collection (its fixture-based loader fails under pytest 9.2: `Node._nodeid` is gone).
# The engine has loaded weights and tokenizer by the time the checkpoint folder goes.
with tempfile.TemporaryDirectory() as _d:
    ENGINE = Engine(
        str(build("llama", Path(_d), tokenizer=True)),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        num_device_blocks=MAX_NUM_SEQS * MAX_MODEL_LEN // BLOCK_SIZE,
        num_host_blocks=0,
        calibrate=False,
    )
VOCAB = ENGINE.model.cfg.vocab_size


def new_app() -> FastAPI:
    return build_app(AsyncEngine(ENGINE, metrics=Metrics(ENGINE.scheduler.config, NAME)), NAME)


CONFIG = schemathesis.Config.from_dict(
    {
        # ~40 s for the file on 2 CPU cores: the same cases every run, none saved
        "generation": {"max-examples": 200, "deterministic": True, "database": "none"},
        "max-stream-events": 100_000,  # read every stream to its end (a cut one races its abort)
        "output": {"sanitization": {"enabled": False}},  # it hides every field named *token*
        "checks": {
            "positive_data_acceptance": {"expected-statuses": ["2xx", "404"]},
            "negative_data_rejection": {"expected-statuses": ["400"]},
        },
    }
)
schema = schemathesis.openapi.from_asgi("/openapi.json", new_app(), config=CONFIG)
asgi.shutdown_lifespans()  # loading the schema started that app's engine thread

# The engine's refusals that depend on the model (``Scheduler::add_request``, ``Engine._tokenize``).
MODEL_LIMITS = re.compile(
    rf"exceeds max_model_len={MAX_MODEL_LEN}$"
    rf"|^((logit_bias|allowed_token_ids|bad_words): )?token id \d+ out of range \[0, {VOCAB}\)$"
    r"|^min_tokens \(\d+\) must be <= max_tokens|^max_tokens must be >= 1 \(0 only with echo\)"
    # a grammar whose text does not compile (JSON Schema cannot say what a regex or Lark grammar
    # is), and two fields that ask for a grammar at once (a rule between fields)
    r"|structured outputs: |^at most one of \[.*\] may constrain a request$"
    # tool_choice against tools: a rule between fields
    r"|^tool_choice .* needs tools$|^tool_choice names .*, which is not among the tools$"
    r"|^tool_choice and a structured output cannot both constrain a request$"
    # more rules between fields (OpenAI's and vLLM's)
    r"|^best_of is not supported \(only best_of == n|^top_logprobs needs logprobs: true$"
    r"|^stream_options is only allowed with stream: true$|^continue_final_message"
    # what the model's chat template refuses (chat_template_kwargs reach it): the template's rules
    r"|^chat template: |^echo is not supported with truncate_prompt_tokens$"
    # the engine's policy: a priority other than 0 needs policy "priority" (vLLM's rule)
    r"|^priority -?\d+ needs the priority scheduling policy"
    # a bad word that is all whitespace, as Python's str.strip() has it (JSON Schema cannot say)
    r"|^bad_words must be a list of words \(not blank\)"
    # masks (allowed_token_ids, bad_words, min_tokens, a grammar) that together forbid every token
    r"|^allowed_token_ids leave no token to sample|^no token is left to sample"
)


def _error(response: Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else None


def positive_data_served(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """``positive_data_acceptance``, but for a refusal that only the model can make: a tolerance
    the schema cannot remove (token counts of text, the vocabulary are not JSON Schema), and
    ``min_tokens`` above ``max_tokens`` (a rule between two fields), a grammar that does not
    compile or two that are asked for at once, a ``tool_choice`` its ``tools`` do not allow,
    ``best_of`` other than ``n``, ``top_logprobs`` without ``logprobs``, ``stream_options``
    without ``stream``, ``continue_final_message`` with ``add_generation_prompt`` or after a
    message that is not an assistant's, a ``priority`` other than 0 on an fcfs engine."""
    err = _error(response)
    if response.status_code == 400 and err is not None and MODEL_LIMITS.search(str(err.get("message"))):
        return None
    return positive_data_acceptance(ctx, response, case)


def openai_error_body(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """An error has OpenAI's body; a bad request is an ``invalid_request_error``."""
    if response.status_code < 400:
        return None
    err = _error(response)
    assert err is not None and set(err) == {"message", "type", "param", "code"}, response.text
    assert isinstance(err["message"], str) and err["message"], response.text
    assert isinstance(err["type"], str), response.text
    assert err["param"] is None or isinstance(err["param"], str), response.text
    assert err["code"] is None or isinstance(err["code"], str), response.text
    if response.status_code == 400:
        assert err["type"] == "invalid_request_error", response.text
    return None


CHECKS = [
    not_a_server_error,
    positive_data_served,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
    openai_error_body,
]


@pytest.fixture
def app() -> Iterator[FastAPI]:
    """A fresh app per operation: schemathesis ends ASGI lifespans after each test, and an
    ``AsyncEngine``'s thread starts once. The ``Engine`` under them is shared."""
    yield new_app()
    asgi.shutdown_lifespans()
    while ENGINE.has_unfinished_requests():  # whatever the stopped thread left, for the next one
        ENGINE.step()


@schema.parametrize()
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # `app` is per operation
def test_api(case: Case, app: FastAPI) -> None:
    case.call_and_validate(app=app, checks=CHECKS)
