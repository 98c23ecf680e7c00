"""Structured outputs in the request body: OpenAI's `response_format` and vLLM's `structured_outputs`.

Both become one decoder StructuredOutput. Here only the shape is judged (types, exactly one kind,
json_schema's name and schema); whether a schema, regex or grammar compiles, and which schema
keywords can be enforced, is the decoder's to say (one rule book), and its errors name the field the
caller used. vLLM's retired `guided_*` fields are refused, naming their replacement, rather than
ignored: ignoring them would run the request unconstrained.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from services.common.errors import InvalidArgument
from services.common.pb import decoder_pb2

from .routes.common import StrictBody

# The retired vLLM fields -> what replaces them.
LEGACY = {"guided_json": "structured_outputs.json", "guided_regex": "structured_outputs.regex",
          "guided_choice": "structured_outputs.choice", "guided_grammar": "structured_outputs.grammar",
          "guided_decoding_backend": "structured_outputs (the backend is always xgrammar)",
          "guided_whitespace_pattern": "structured_outputs (JSON is always written compactly)"}
# The decoder names its field structured_output; the caller should read the one it sent.
DECODER_PARAM = "structured_output"


class TextFormat(StrictBody):
    type: Literal["text"]


class JSONObjectFormat(StrictBody):
    type: Literal["json_object"]


class JSONSchema(StrictBody):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="the schema's name (OpenAI's rule: letters,"
                                                                    " digits, _ and -, at most 64)")
    description: str | None = Field(None, description="what the output is for; not shown to the model")
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the output must validate"
                                                                " against (see docs/api.md for the keywords"
                                                                " refused)")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class JSONSchemaFormat(StrictBody):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(StrictBody):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON Schema (object or its"
                                                                              " JSON text)")
    regex: str | None = Field(None, description="a regular expression the whole output matches")
    choice: list[str] | None = Field(None, description="the output is exactly one of these strings")
    grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's dialect, `root ::= ...`)")
    json_object: bool | None = Field(None, description="true: any JSON object")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object))
                 if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object; got "
                             f"{', '.join(given) or 'none'}")
        return self

    def to_proto(self) -> decoder_pb2.StructuredOutput:
        if self.json_ is not None:
            text = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return decoder_pb2.StructuredOutput(json_schema=text)
        if self.regex is not None:
            return decoder_pb2.StructuredOutput(regex=self.regex)
        if self.choice is not None:
            return decoder_pb2.StructuredOutput(choice=decoder_pb2.StructuredOutput.Choices(choices=self.choice))
        if self.grammar is not None:
            return decoder_pb2.StructuredOutput(grammar=self.grammar)
        return decoder_pb2.StructuredOutput(json_object=bool(self.json_object))


def _retired(name: str):
    # Hidden from the OpenAPI schema: documented as refused, not offered.
    return Field(None, description=f"refused: use {LEGACY[name]}")


class StructuredFields(StrictBody):
    """The request fields that constrain the output; mixed into SamplingFields."""

    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text (no constraint), json_object"
                                                                     " (any JSON object) or json_schema")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: one of json, regex, choice,"
                                                                           " grammar, json_object")
    guided_json: SkipJsonSchema[Any] = _retired("guided_json")
    guided_regex: SkipJsonSchema[Any] = _retired("guided_regex")
    guided_choice: SkipJsonSchema[Any] = _retired("guided_choice")
    guided_grammar: SkipJsonSchema[Any] = _retired("guided_grammar")
    guided_decoding_backend: SkipJsonSchema[Any] = _retired("guided_decoding_backend")
    guided_whitespace_pattern: SkipJsonSchema[Any] = _retired("guided_whitespace_pattern")

    @field_validator(*LEGACY, mode="before")
    @classmethod
    def _retired_field(cls, value, info: ValidationInfo):
        # Runs only for a field the body sent (even as null): refused whatever its value.
        raise ValueError(f"no longer supported (vLLM retired it): use {LEGACY[info.field_name]}")

    @property
    def constraint_field(self) -> str | None:
        """The body field that carries the constraint, if any."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return None

    def structured_output(self) -> decoder_pb2.StructuredOutput | None:
        """The decoder's StructuredOutput, or None. Raises InvalidArgument for two constraints at once."""
        fmt = None if self.response_format is None or self.response_format.type == "text" else self.response_format
        if fmt is not None and self.structured_outputs is not None:
            raise InvalidArgument("send one constraint: response_format or structured_outputs, not both",
                                  param="structured_outputs")
        if self.structured_outputs is not None:
            return self.structured_outputs.to_proto()
        if isinstance(fmt, JSONObjectFormat):
            return decoder_pb2.StructuredOutput(json_object=True)
        if isinstance(fmt, JSONSchemaFormat):
            return decoder_pb2.StructuredOutput(json_schema=json.dumps(fmt.json_schema.schema_))
        return None
