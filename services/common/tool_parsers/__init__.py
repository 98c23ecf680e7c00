"""Parsers of a model's own tool-call format, named as vLLM names them (`--tool-call-parser hermes`).

The decoder owns the model and its template, so it takes the flag and reports the name
(GetModelInfoResponse.tool_call_parser); the gateway reads `tool_choice: "auto"` output with the parser
of that name. Parsers read text only (no tokenizer), which is all the gateway has. The events they return
are in parser.py.
"""
from __future__ import annotations

from .hermes import HermesParser
from .parser import CallArguments, CallName, Content, Event, ToolCallParser

PARSERS: dict[str, type[ToolCallParser]] = {HermesParser.name: HermesParser}
NAMES: tuple[str, ...] = tuple(PARSERS)
HELP = "; ".join(f"{name} ({parser.about})" for name, parser in PARSERS.items())

__all__ = ["PARSERS", "NAMES", "HELP", "ToolCallParser", "HermesParser", "Content", "CallName", "CallArguments",
           "Event"]
