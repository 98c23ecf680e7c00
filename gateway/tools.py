"""Tool calling in a chat request: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, and what each
choice of them asks of the decoder.

- "none": the tools go to the template; the answer is plain content.
- "auto" (the default with tools): the tools go to the template, and the answer is read with the model's
  own parser (the decoder's --tool-call-parser); with parallel_tool_calls false the parser's end tag is
  a stop string, so generation ends after one call.
- "required": a JSON schema of an array of calls (gateway/forced_calls.py) forces the answer, read back
  with RequiredCalls.
- {"type": "function", "function": {"name"}}: that function's parameters are the schema, read back with
  NamedCall.

The tools always reach the template (OpenAI's "none" still lets the model know them). Here the shapes are
judged (types, names, that parameters are a JSON Schema of an object) and the combinations; whether a
forced schema compiles is the decoder's to say, and its structured_output errors are renamed to `tools`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema
from pydantic import Field, field_validator

from services.common.errors import InvalidArgument, Unsupported
from services.common.pb import decoder_pb2
from services.common.tool_parsers import PARSERS, ToolCallParser

from .forced_calls import NamedCall, RequiredCalls, object_schema, required_schema
from .routes.common import StrictBody

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"   # OpenAI's rule


def check_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters must be a JSON Schema (checked against its meta-schema) of an object."""
    if not isinstance(schema.get("$schema", ""), str):
        raise ValueError("parameters is not a valid JSON Schema: $schema must be a string (a meta-schema URI)")
    # The draft its $schema names (2020-12 without one); an unknown URI falls back to 2020-12.
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"parameters is not a valid JSON Schema{f' at {where}' if where else ''}: "
                         f"{exc.message}") from None
    except RecursionError:
        raise ValueError("parameters nests too deeply to check") from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise ValueError(f"parameters must be the schema of an object (type: object), got type {kind!r}")
    return schema


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=FUNCTION_NAME, description="letters, digits, _ and -, at most 64")
    description: str | None = Field(None, description="shown to the model by its chat template")
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of an object; omitted: no"
                                                                " arguments")
    strict: bool | None = Field(None, description="true is enforced under tool_choice required or a named"
                                                  " function (always forced); under auto it is refused")

    @field_validator("parameters")
    @classmethod
    def _schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return value if value is None else check_parameters(value)


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition

    def to_json(self) -> dict:
        """The tool as the chat template reads it (OpenAI's shape, unset fields left out)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields ask for. mode: "" (no tools), none, auto, required or named."""

    mode: str = ""
    schema: dict | None = None        # forced modes: the JSON schema of the output
    stop: str | None = None           # auto with parallel_tool_calls false: ends generation after one call
    parser: Callable[[], ToolCallParser] | None = field(default=None, compare=False)

    def apply(self, sampling: decoder_pb2.SamplingParams) -> None:
        """Add the forced schema or the stop string to the decoder's SamplingParams."""
        if self.schema is not None:
            sampling.structured_output.CopyFrom(decoder_pb2.StructuredOutput(json_schema=json.dumps(self.schema)))
        if self.stop is not None and self.stop not in sampling.stop:
            sampling.stop.append(self.stop)


NO_TOOLS = ToolPlan()


def _auto_refusal(model: str) -> InvalidArgument:
    return InvalidArgument(
        f'model {model!r} cannot choose tool calls itself (tool_choice "auto", the default with tools): its '
        'decoder was not started with --enable-auto-tool-choice --tool-call-parser NAME, which needs a chat '
        'template that renders tools (a tool-capable model such as Qwen2.5 or Qwen3). Send tool_choice '
        '"required" or {"type": "function", "function": {"name": ...}} (the calls are then forced by a grammar),'
        ' or "none"', param="tool_choice")


class ToolFields(StrictBody):
    """The request fields of tool calling; mixed into ChatRequest."""

    tools: list[Tool] | None = Field(None, min_length=1, description="functions the model may call (at least"
                                                                     " one; omit the field for none)")
    tool_choice: ToolChoice | None = Field(None, description='none, auto (the default with tools), required, or'
                                                             ' {"type": "function", "function": {"name"}}')
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default true)")

    def tool_plan(self, model: str, parser_name: str | None, constraint_field: str | None) -> ToolPlan:
        """The plan for these fields on `model`, whose decoder reads "auto" with parser_name (None: it cannot).

        Raises InvalidArgument naming the field: tool_choice or parallel_tool_calls without tools, two tools of
        one name, a named tool that is not in tools, auto on a model without a parser, strict under auto, and a
        response_format / structured_outputs constraint beside auto or a forced call.
        """
        if self.tools is None:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    raise InvalidArgument(f"{name} is only allowed when tools are specified", param=name)
            return NO_TOOLS
        functions = [t.function for t in self.tools]
        names = [f.name for f in functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidArgument(f"tools: function {twice[0]!r} is defined more than once", param="tools")
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidArgument(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                                  f"({', '.join(names)})", param="tool_choice")
        if choice == "none":
            return ToolPlan("none")
        mode = "named" if isinstance(choice, NamedToolChoice) else choice
        if constraint_field is not None:
            why = ("would rule out the model's tool calls" if mode == "auto" else
                   "would be a second constraint: the calls are already forced")
            raise InvalidArgument(f'{constraint_field} cannot be combined with tool_choice {mode!r}: it {why}; '
                                  f'send tool_choice "none" to answer in the format', param=constraint_field)
        parallel = self.parallel_tool_calls is not False
        if mode == "auto":
            strict = next((f.name for f in functions if f.strict), None)
            if strict is not None:
                raise InvalidArgument(f'tools: function {strict!r} is strict, which tool_choice "auto" cannot '
                                      f'enforce (the model writes its calls freely and they are parsed); use '
                                      f'tool_choice "required" or a named function, or strict false',
                                      param="tools")
            if not parser_name:
                raise _auto_refusal(model)
            parser = PARSERS.get(parser_name)
            if parser is None:
                raise Unsupported(f"model {model!r} writes tool calls in the {parser_name!r} format, which this "
                                  f"gateway cannot parse (it knows {', '.join(PARSERS)})", param="tool_choice")
            return ToolPlan("auto", stop=None if parallel else parser.call_end, parser=parser)
        if mode == "named":
            function = functions[names.index(choice.function.name)]
            return ToolPlan("named", schema=object_schema(function.parameters),
                            parser=lambda: NamedCall(function.name))
        return ToolPlan("required", schema=required_schema([(f.name, f.parameters) for f in functions], parallel),
                        parser=RequiredCalls)
