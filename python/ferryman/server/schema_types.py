"""The constrained field types of the API's request bodies: JSON's integers (strict, ``2.0``
allowed, bounded so a value the schema allows never overflows deeper down), token ids, the
prompt's four shapes, logit biases, and ``Unsupported`` (an OpenAI field ferryman refuses by
name), and ``Body``, the base of every request body (strict, unknown fields warned about, and
``null`` for a field with a default taken as that field left out, as OpenAI's nullable fields and
vLLM's ``Optional`` ones read)."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from annotated_types import Ge, Le, MinLen
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

log = logging.getLogger("ferryman.server")


def _nullable_defaults(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The published schema says what ``Body._null_is_unset`` accepts: every field with a
    default other than null also takes null."""
    props = schema.get("properties", {})
    for name, f in cls.model_fields.items():
        prop = props.get(f.alias or name)
        if f.is_required() or f.default is None or prop is None:
            continue
        if "anyOf" in prop:
            if not any(a.get("type") == "null" for a in prop["anyOf"]):
                prop["anyOf"].append({"type": "null"})
            continue
        meta = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
        props[f.alias or name] = {"anyOf": [prop, {"type": "null"}], **meta}


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_nullable_defaults)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """``null`` for a field with a default is that field left out: the default applies (and
        the model's generation defaults, which fill the fields a request leaves unset)."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        defaulted = {f.alias or k for k, f in fields.items() if not f.is_required() and f.default is not None}
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}

    @model_validator(mode="after")
    def _warn_unknown(self) -> Any:
        """Unknown fields are ignored with a logged warning (vLLM's behaviour)."""
        if self.model_extra:
            log.warning("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


I32_MAX = 2**31 - 1
# JSON's interoperable integers (I-JSON): a double holds each exactly, so a bound means the same to
# every client and validator (near 2**63, 9.223372036854776e18 both is and is not within int64).
JSON_INT_MAX = 2**53 - 1


def _json_integer(v: Any) -> Any:
    """JSON Schema's integers include numbers written with a zero fraction (``2.0``)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# Last in an ``Annotated``, so it runs first and the bounds before it stay in the JSON schema.
JSON_INT = BeforeValidator(_json_integer)


def _json_false(v: Any) -> Any:
    """``false`` and nothing else (a ``Literal[False]`` alone takes ``0``)."""
    if v is not False:
        raise PydanticCustomError("literal_error", "Input should be False")
    return v


def _json_true(v: Any) -> Any:
    """``true`` and nothing else (a ``Literal[True]`` alone takes ``1``)."""
    if v is not True:
        raise PydanticCustomError("literal_error", "Input should be True")
    return v


def _token_id(v: int) -> int:
    if not 0 <= v <= I32_MAX:
        raise PydanticCustomError("token_id", "token id {v} out of range [0, 2**31)", {"v": v})
    return v


def _not_empty(v: Any) -> Any:
    if v == "" or v == [] or (isinstance(v, list) and any(p == "" or p == [] for p in v)):
        raise PydanticCustomError("empty_prompt", "prompt must not be empty")
    return v


def _prompt_shape(v: Any) -> str | None:
    if isinstance(v, str):
        return "text"
    if not isinstance(v, list):
        return None
    if all(isinstance(p, str) for p in v):
        return "texts"
    return "token_id_lists" if all(isinstance(p, list) for p in v) else "token_ids"


TokenId = Annotated[
    int,
    AfterValidator(_token_id),
    WithJsonSchema({"type": "integer", "minimum": 0, "maximum": I32_MAX}),
    JSON_INT,
]
TokenIds = Annotated[list[TokenId], MinLen(1)]
Text = Annotated[str, MinLen(1)]
# One shape or another by the JSON type (so an error names the shape meant); an empty prompt or
# part is refused first, with one message.
Prompt = Annotated[
    Annotated[Text, Tag("text")]
    | Annotated[list[Text], MinLen(1), Tag("texts")]
    | Annotated[TokenIds, Tag("token_ids")]
    | Annotated[list[TokenIds], MinLen(1), Tag("token_id_lists")],
    Discriminator(
        _prompt_shape,
        custom_error_type="prompt_type",
        custom_error_message="prompt must be a string, a list of strings, a list of token ids or a "
        "list of token-id lists",
    ),
    BeforeValidator(_not_empty),
]
BiasTokenId = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # a token id, as JSON keys are strings
# keys that are not token ids are refused, so the schema says so (pydantic's own leaves them open)
LogitBias = Annotated[
    dict[BiasTokenId, Annotated[float, Field(ge=-100, le=100)]],
    WithJsonSchema(
        {
            "type": "object",
            "patternProperties": {r"^[0-9]{1,9}$": {"type": "number", "minimum": -100, "maximum": 100}},
            "additionalProperties": False,
        }
    ),
]
MaxTokens = Annotated[int, Ge(1), Le(JSON_INT_MAX), JSON_INT]
TopLogprobs = Annotated[int, Ge(0), Le(20), JSON_INT]


def _refuse(v: Any, info: ValidationInfo) -> Any:
    if v is not None:
        raise PydanticCustomError("unsupported", f"{info.field_name} is not supported by ferryman")
    return v


# An OpenAI field ferryman does not implement: the schema allows only null (or leaving it out),
# and a value is refused with a message that names the field (never silently ignored).
Unsupported = Annotated[None, BeforeValidator(_refuse)]
