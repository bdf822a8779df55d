"""The request fields that ask for structured output, and the one ``StructuredOutputsParams``
they come to: OpenAI's ``response_format`` (``json_object``, or ``json_schema`` with its schema;
``text`` asks for nothing), vLLM's ``structured_outputs`` body (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` aliases. At most one of them may constrain a request;
two are a 400 that names both."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import MinLen
from pydantic import ConfigDict, Field

from ferryman.sampling_params import StructuredOutputsParams
from ferryman.server.schema_types import Body

Schema = dict[str, Any] | bool


class ResponseFormatText(Body):
    type: Literal["text"]


class ResponseFormatJsonObject(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    name: str = "response"
    description: str | None = None
    # "schema" would shadow pydantic's own attribute
    schema_: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormatJsonSchema(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


class StructuredOutputsBody(Body):
    """vLLM's ``structured_outputs`` extra body: exactly one field."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    # "json" would shadow pydantic's own method
    json_: Schema | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], MinLen(1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(Body):
    """Mixed into the sampling fields of both endpoints."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: Schema | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], MinLen(1)] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The request's constraint; ``ValueError`` (a 400) if two fields ask for one, or the one
        given is empty."""
        found: dict[str, StructuredOutputsParams] = {}
        rf = self.response_format
        if isinstance(rf, ResponseFormatJsonObject):
            found["response_format"] = StructuredOutputsParams(json_object=True)
        elif isinstance(rf, ResponseFormatJsonSchema):
            schema = rf.json_schema.schema_
            found["response_format"] = (
                StructuredOutputsParams(json_object=True)
                if schema is None
                else StructuredOutputsParams(json=_schema(schema))
            )
        if self.structured_outputs is not None:
            so = self.structured_outputs
            found["structured_outputs"] = StructuredOutputsParams(
                json=None if so.json_ is None else _schema(so.json_),
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object,
            )
        if self.guided_json is not None:
            found["guided_json"] = StructuredOutputsParams(json=_schema(self.guided_json))
        if self.guided_regex is not None:
            found["guided_regex"] = StructuredOutputsParams(regex=self.guided_regex)
        if self.guided_choice is not None:
            found["guided_choice"] = StructuredOutputsParams(choice=self.guided_choice)
        if self.guided_grammar is not None:
            found["guided_grammar"] = StructuredOutputsParams(grammar=self.guided_grammar)
        if len(found) > 1:
            raise ValueError(f"at most one of {sorted(found)} may constrain a request")
        return next(iter(found.values()), None)


def _schema(schema: Schema | str) -> dict[str, Any] | str:
    """A schema as ``StructuredOutputsParams.json`` takes it (``true`` / ``false`` as text)."""
    if isinstance(schema, bool):
        return "true" if schema else "false"
    return schema
