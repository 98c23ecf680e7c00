"""Tool conversations through the chat template: the hermes template renders tools, an assistant's tool calls
and tool answers exactly as transformers' apply_chat_template does; the decoder's proto -> template messages
conversion parses call arguments as vLLM does; which templates count as rendering tools."""
from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument, Unsupported
from services.common.pb import decoder_pb2
from services.decoder.server.config import DecoderConfig
from services.decoder.server.messages import template_messages, template_tools
from services.decoder.text.chat_template import ChatTemplate
from services.decoder.text.tokenizer import Tokenizer
from tests.decoder.text.conftest import CHATML_TEMPLATE, hf_tokenizer
from tests.decoder.text.test_chat_template import _folder_with_template
from tests.decoder.text.tool_template import HERMES_TEMPLATE, TOOLS

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "celsius"}}}
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    {"role": "assistant", "content": "21 °C.", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def hermes(bytelevel_dir, tmp_path_factory):
    folder = _folder_with_template(bytelevel_dir, tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE)
    return ChatTemplate.from_folder(folder, Tokenizer.from_folder(folder)), hf_tokenizer(folder)


@pytest.mark.parametrize("tools", [TOOLS, None])
@pytest.mark.parametrize("gen", [True, False])
def test_tool_conversations_render_as_transformers_does(hermes, tools, gen):
    template, ref = hermes
    ours = template.render(ROUND_TRIP, add_generation_prompt=gen, tools=tools)
    assert ours == ref.apply_chat_template(ROUND_TRIP, tokenize=False, add_generation_prompt=gen, tools=tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in ours and "<tool_response>\n{\"temp\": 21}\n</tool_response>" in ours
    assert ("<tools>" in ours) == (tools is not None)


def test_which_templates_render_tools(hermes, smollm2_dir, bytelevel_dir, tmp_path):
    assert hermes[0].supports_tools
    smollm2 = ChatTemplate.from_folder(smollm2_dir, Tokenizer.from_folder(smollm2_dir))
    assert not smollm2.supports_tools                        # what `make up` serves: no tool format
    assert not ChatTemplate(CHATML_TEMPLATE, {}).supports_tools
    # Assigning a variable called tools is not reading the caller's tools.
    assert not ChatTemplate("{% set tools = 1 %}{{ messages[0].content }}", {}).supports_tools
    assert ChatTemplate({"default": "D", "tool_use": "{{ tools | length }}"}, {}).supports_tools


def test_tool_calls_a_template_would_drop_are_refused(smollm2_dir):
    smollm2 = ChatTemplate.from_folder(smollm2_dir, Tokenizer.from_folder(smollm2_dir))
    with pytest.raises(Unsupported, match="does not render an assistant message's tool_calls") as exc:
        smollm2.render(ROUND_TRIP, add_generation_prompt=True, tools=TOOLS)
    assert exc.value.param == "messages"
    # Without calls in the conversation, tools are simply not shown (the template never reads them).
    plain = [m for m in ROUND_TRIP if not m.get("tool_calls")]
    assert smollm2.render(plain, add_generation_prompt=True, tools=TOOLS) == smollm2.render(
        plain, add_generation_prompt=True)


def proto_chat(**kw) -> decoder_pb2.ChatMessages:
    return decoder_pb2.ChatMessages(messages=[
        decoder_pb2.ChatMessage(role="user", content=[decoder_pb2.ContentPart(text="hi")], name="ann"),
        decoder_pb2.ChatMessage(role="assistant", tool_calls=[decoder_pb2.ToolCall(
            id="call_1", name="get_weather", arguments='{"city": "Paris", "unit": "celsius"}')]),
        decoder_pb2.ChatMessage(role="tool", content=[decoder_pb2.ContentPart(text="21")], tool_call_id="call_1"),
    ], **kw)


def test_proto_messages_become_what_templates_read(hermes):
    messages = template_messages(proto_chat())
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": [{"type": "text", "text": "21"}], "tool_call_id": "call_1"}]
    assert template_tools(proto_chat()) is None
    assert template_tools(proto_chat(tools_json=json.dumps(TOOLS))) == TOOLS
    text = hermes[0].render(messages, add_generation_prompt=True, tools=TOOLS)
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text


@pytest.mark.parametrize("message, param, says", [
    (decoder_pb2.ChatMessage(role="assistant", tool_calls=[decoder_pb2.ToolCall(id="a", name="f", arguments="{x")]),
     "messages", "not valid JSON"),
    (decoder_pb2.ChatMessage(role="assistant", tool_calls=[decoder_pb2.ToolCall(id="a", name="f", arguments="[1]")]),
     "messages", "JSON object"),
    (decoder_pb2.ChatMessage(role="user", tool_calls=[decoder_pb2.ToolCall(id="a", name="f", arguments="{}")]),
     "messages", "only assistant"),
    (decoder_pb2.ChatMessage(role="user", tool_call_id="a"), "messages", "only tool"),
])
def test_bad_proto_messages_are_refused(message, param, says):
    with pytest.raises(InvalidArgument, match=says) as exc:
        template_messages(decoder_pb2.ChatMessages(messages=[message]))
    assert exc.value.param == param


@pytest.mark.parametrize("tools_json, says", [("{oops", "not valid JSON"), ('{"a": 1}', "list of objects"),
                                              ("[1]", "list of objects")])
def test_bad_tools_json_is_refused(tools_json, says):
    with pytest.raises(InvalidArgument, match=says) as exc:
        template_tools(decoder_pb2.ChatMessages(tools_json=tools_json))
    assert exc.value.param == "tools"


@pytest.mark.parametrize("flags, says", [
    (dict(enable_auto_tool_choice=True), "needs --tool-call-parser"),
    (dict(tool_call_parser="hermes"), "add --enable-auto-tool-choice"),
    (dict(enable_auto_tool_choice=True, tool_call_parser="mistral"), "choose from hermes"),
])
def test_tool_flags_are_checked_at_start(flags, says):
    with pytest.raises(ValueError, match=says):
        DecoderConfig(model="m", **flags)
    assert DecoderConfig(model="m", enable_auto_tool_choice=True, tool_call_parser="hermes").tool_call_parser
