"""The model's own chat template, rendered with sandboxed jinja2 exactly as transformers 5 renders it.

Where the template comes from (transformers' precedence): chat_template.jinja and chat_templates/*.jinja
in the folder win over tokenizer_config.json's "chat_template", which is a string or a list of
{"name", "template"}. With several named templates, "tool_use" is picked when tools are given and
"default" otherwise.

The jinja environment copies transformers' `_cached_compile_jinja_template`: ImmutableSandboxedEnvironment
with trim_blocks, lstrip_blocks and loopcontrols; a `tojson` that does not HTML-escape; the globals
`raise_exception`, `strftime_now`, a limited `dict` and an underscore-refusing `namespace`. The
`{% generation %}` tag is parsed and rendered transparently (we never need assistant masks).

Messages are validated before rendering (unknown role, wrong content type -> InvalidArgument) and
converted to plain JSON data, so the sandbox never sees caller objects. A rendered prompt is encoded
without special tokens, as `apply_chat_template(tokenize=True)` does: the template writes its own.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.text.tokenizer import Tokenizer, read_json

ROLES = frozenset({"system", "user", "assistant", "tool"})
TEXT_PART = "text"
# Image parts reach the template as {"type": "image"}: multimodal templates only test for the part's type
# (Qwen2-VL writes its vision placeholders from it); the pixels travel beside the prompt, never through jinja.
IMAGE_PART_TYPES = frozenset({"image", "image_url"})
# Names a message's reasoning is passed under; templates read the first (transformers aliases them the same way).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged (transformers' AssistantTracker
    only records where the body lands, for assistant masks, which serving never asks for)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    # Templates call this to refuse a conversation (e.g. roles that do not alternate): a user error.
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's built-in tojson HTML-escapes <, >, & and ' which would change the prompt; transformers overrides it.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (attribute access on a type is an escape)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names so a template cannot reach CPython internals through it."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's signature trick so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Template source -> compiled template in transformers' environment (cached: replicas share one model)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _iterates_content(source: str) -> bool:
    """Whether the template loops over a message's content (an OpenAI-parts template) or uses it as a string.

    Parsed from the AST: a `for` whose iterable is `<x>.content` or `<x>['content']`.
    """
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    for loop in env.parse(source).find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Filter):  # `for p in message.content | selectattr(...)`
            it = it.node
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const) \
                and it.arg.value == "content":
            return True
    return False


@lru_cache(maxsize=16)
def _reads_tools(source: str) -> bool:
    """Whether the template reads the `tools` variable at all: one that never does cannot show the model its
    tools, so it has no tool-call format to parse (SmolLM2-135M-Instruct's is such a template)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    return any(node.name == "tools" and node.ctx == "load" for node in env.parse(source).find_all(jinja2.nodes.Name))


@lru_cache(maxsize=16)
def _reads_tool_calls(source: str) -> bool:
    """Whether the template reads a message's `tool_calls` (`m.tool_calls` or `m['tool_calls']`)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    tree = env.parse(source)
    if any(n.attr == "tool_calls" for n in tree.find_all(jinja2.nodes.Getattr)):
        return True
    return any(isinstance(n.arg, jinja2.nodes.Const) and n.arg.value == "tool_calls"
               for n in tree.find_all(jinja2.nodes.Getitem))


def _plain(value, where: str):
    """Caller data -> plain JSON types (dict/list/str/int/float/bool/None); anything else is refused."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgument(f"{where}: keys must be strings, got {key!r}", param="messages")
            out[key] = _plain(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise InvalidArgument(f"{where}: unsupported value of type {type(value).__name__}", param="messages")


def _content_parts(content: list, where: str) -> list[dict]:
    """A list of OpenAI-style parts -> [{"type": "text", "text": str} | {"type": "image"}]."""
    parts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if not isinstance(part, Mapping):
            raise InvalidArgument(f"{at}: a content part must be an object, got {type(part).__name__}",
                                  param="messages")
        kind = part.get("type")
        if kind == TEXT_PART:
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{at}: a text part needs a string 'text'", param="messages")
            parts.append({"type": TEXT_PART, "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            parts.append({"type": "image"})
        else:
            raise InvalidArgument(f"{at}: unsupported content part type {kind!r}", param="messages")
    return parts


def normalize_messages(messages, parts_template: bool) -> list[dict]:
    """Validate chat messages and return plain copies ready for the template.

    Args:
        messages: list of {"role": str, "content": str | list[part] | None, ...other JSON fields}.
        parts_template: True when the template iterates content parts; for a string template, text-only part
            lists are joined with "\\n" (what OpenAI-compatible servers do) and image parts are refused.
    Returns:
        list of dicts; keys whose value is None are dropped, as transformers drops them.
    Raises:
        InvalidArgument: not a non-empty list of objects, unknown role, wrong content type.
        Unsupported: image parts for a template that takes text only (nothing is silently dropped).
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgument("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"{where} must be an object, got {type(message).__name__}", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"{where}: unknown role {role!r} (expected one of {sorted(ROLES)})",
                                  param="messages")
        # content is checked below on its own; keeping it in place keeps the caller's key order (tojson shows it).
        plain = {k: (v if k == "content" else _plain(v, f"{where}.{k}")) for k, v in message.items() if v is not None}
        content = message.get("content")
        if content is None:
            # An assistant turn that only calls tools has no content; every other turn must say something.
            if not (role == "assistant" and message.get("tool_calls")):
                raise InvalidArgument(f"{where}: content is required", param="messages")
        elif isinstance(content, str):
            plain["content"] = content
        elif isinstance(content, (list, tuple)):
            parts = _content_parts(content, f"{where}.content")
            if parts_template:
                plain["content"] = parts
            elif any(p["type"] != TEXT_PART for p in parts):
                raise Unsupported(f"{where}: this model's chat template takes text only, not images",
                                  param="messages")
            else:
                plain["content"] = "\n".join(p["text"] for p in parts)
        else:
            raise InvalidArgument(f"{where}: content must be a string or a list of parts, got "
                                  f"{type(content).__name__}", param="messages")
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _load_templates(folder: Path, tokenizer_config: dict) -> str | dict[str, str] | None:
    """The folder's template(s): one string, {name: source}, or None when the model has none."""
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_templates").is_dir():
        for path in sorted((folder / "chat_templates").glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, (list, tuple)):
        return {t["name"]: t["template"] for t in raw}
    return raw


class ChatTemplate:
    """One model's chat template(s) plus the special-token variables templates read.

    Args:
        templates: a template source, or {name: source}.
        special_tokens_map: {"bos_token": "<s>", ...}; passed to the template as variables.
    """

    def __init__(self, templates: str | dict[str, str], special_tokens_map: Mapping[str, str]):
        self.templates = templates
        self.special_tokens_map = dict(special_tokens_map)

    @classmethod
    def from_folder(cls, folder: str | Path, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The folder's template, or None when the model ships none (it then serves completions only)."""
        folder = Path(folder)
        templates = _load_templates(folder, read_json(folder / "tokenizer_config.json"))
        return None if templates is None else cls(templates, tokenizer.special_tokens_map)

    def source(self, tools=None) -> str:
        """The template source a request uses (transformers' get_chat_template selection)."""
        if isinstance(self.templates, str):
            return self.templates
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise InvalidArgument(f"the model has several chat templates and no default: {sorted(self.templates)}")

    @property
    def supports_tools(self) -> bool:
        """Whether the template a request with tools uses renders them."""
        return _reads_tools(self.source(tools=[]))

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool, tools=None,
               documents=None, **template_kwargs) -> str:
        """Messages -> the prompt text. template_kwargs override the special-token variables, as in transformers.

        add_generation_prompt has no default on purpose: transformers defaults to False, serving wants True.

        Raises InvalidArgument for bad messages and for conversations the template refuses (raise_exception),
        Unsupported for tool_calls the template would not render.
        """
        source = self.source(tools)
        chat = normalize_messages(messages, parts_template=_iterates_content_cached(source))
        if any(m.get("tool_calls") for m in chat) and not _reads_tool_calls(source):
            # The template would render the turn without its calls: refused, not silently dropped.
            raise Unsupported("this model's chat template does not render an assistant message's tool_calls (it has "
                              "no tool-call format); send the calls and their results as text content instead",
                              param="messages")
        variables = {**self.special_tokens_map, **_plain(template_kwargs, "chat_template_kwargs")}
        try:
            return compile_template(source).render(
                messages=chat, tools=_plain(tools, "tools"), documents=_plain(documents, "documents"),
                add_generation_prompt=bool(add_generation_prompt), **variables)
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception, undefined fields the caller left out, sandbox refusals: all follow from the input.
            raise InvalidArgument(f"chat template refused the messages: {exc}", param="messages") from exc

    def encode(self, tokenizer: Tokenizer, messages: Sequence[Mapping], *, add_generation_prompt: bool,
               **kwargs) -> list[int]:
        """Messages -> prompt ids [T]: render, then encode without adding special tokens (the template wrote them)."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False)


@lru_cache(maxsize=16)
def _iterates_content_cached(source: str) -> bool:
    return _iterates_content(source)
