"""A hermes-style chat template (the tool format of Qwen2.5, Qwen3 and Hermes 2/3), written for the tests.

Tools go in the system turn inside <tools></tools>; an assistant's calls are written as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; a tool's answer is a user turn inside
<tool_response></tool_response>. ChatML markers as SmolLM2's tokenizer has them.
"""
from __future__ import annotations

# Every piece of text is written by an expression, so `{%-` trimming never eats a newline the format needs.
HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions. Their signatures are inside <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each call, answer with a JSON object inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": TIME}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
