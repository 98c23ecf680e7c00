"""Chat template vs transformers' apply_chat_template: rendered text and ids; message validation."""
from __future__ import annotations

import json
import shutil

import pytest

from services.common.errors import InvalidArgument, Unsupported
from services.decoder.text.chat_template import ChatTemplate, normalize_messages
from services.decoder.text.tokenizer import Tokenizer
from tests.decoder.text.conftest import hf_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 😀, ça va?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 日本 <b>&</b>?"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced  \n\n lines "},
     {"role": "assistant", "content": "ok"}],
]
# The byte-fallback fixture's [INST] template raises on system turns.
USER_ASSISTANT = [c for c in CONVERSATIONS if all(m["role"] in ("user", "assistant") for m in c)]


def _load(folder):
    tok = Tokenizer.from_folder(folder)
    return tok, ChatTemplate.from_folder(folder, tok), hf_tokenizer(folder)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_and_ids_match_transformers(any_dir, add_generation_prompt):
    tok, template, ref = _load(any_dir)
    convs = USER_ASSISTANT if "bytefallback" in str(any_dir) else CONVERSATIONS
    for conv in convs:
        text = template.render(conv, add_generation_prompt=add_generation_prompt)
        assert text == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids = template.encode(tok, conv, add_generation_prompt=add_generation_prompt)
        assert ids == ref.apply_chat_template(conv, tokenize=True, return_dict=False,
                                              add_generation_prompt=add_generation_prompt)


def test_smollm2_prompt_is_chatml(smollm2_dir):
    tok, template, _ = _load(smollm2_dir)
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = template.encode(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ids[0] == tok.token_to_id("<|im_start|>")


def _folder_with_template(src, tmp_path, template, **config_extra):
    folder = tmp_path / "tok"
    shutil.copytree(src, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=template, **config_extra)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_environment_matches_transformers(bytelevel_dir, tmp_path):
    # tojson without HTML escaping and with its options, loop controls, namespace, dict(), {% generation %},
    # the special-token variables, trim_blocks/lstrip_blocks whitespace handling, and extra kwargs.
    source = (
        "{% set ns = namespace(n=0) %}\n"
        "  {% for m in messages %}\n"
        "    {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "    {% set ns.n = ns.n + 1 %}\n"
        "{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}|{{ dict(a=1) | tojson }}\n"
        "{% generation %}{{ m.content }}{% endgeneration %}\n"
        "    {% if ns.n > 1 %}{% break %}{% endif %}\n"
        "  {% endfor %}\n"
        "{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ unk_token }}|{{ tools | tojson }}|{{ custom }}"
        "{% if add_generation_prompt %}GEN{% endif %}"
    )
    folder = _folder_with_template(bytelevel_dir, tmp_path, source)
    tok, template, ref = _load(folder)
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "<a href='x'>&amp;</a> é"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "never"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for gen in (True, False):
        ours = template.render(conv, add_generation_prompt=gen, tools=tools, custom="X")
        assert ours == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, tools=tools,
                                               custom="X")
        assert "<a href='x'>&amp;</a>" in ours and "never" not in ours


def test_strftime_now_is_available(bytelevel_dir, tmp_path):
    folder = _folder_with_template(bytelevel_dir, tmp_path, "{{ strftime_now('%Y') }}")
    tok, template, ref = _load(folder)
    conv = [{"role": "user", "content": "x"}]
    assert template.render(conv, add_generation_prompt=False) == ref.apply_chat_template(conv, tokenize=False)


def test_named_templates_pick_default_or_tool_use(bytelevel_dir, tmp_path):
    named = [{"name": "default", "template": "D{{ messages[0].content }}"},
             {"name": "tool_use", "template": "T{{ tools | length }}"}]
    folder = _folder_with_template(bytelevel_dir, tmp_path, named)
    tok, template, ref = _load(folder)
    conv = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert template.render(conv, add_generation_prompt=False) == ref.apply_chat_template(conv, tokenize=False) == "Dx"
    ours = template.render(conv, tools=tools, add_generation_prompt=False)
    assert ours == ref.apply_chat_template(conv, tokenize=False, tools=tools) == "T1"


def test_chat_template_jinja_file_wins_over_config(bytelevel_dir, tmp_path):
    folder = _folder_with_template(bytelevel_dir, tmp_path, "CONFIG")
    (folder / "chat_template.jinja").write_text("FILE{{ messages | length }}")
    tok, template, ref = _load(folder)
    conv = [{"role": "user", "content": "x"}]
    ours = template.render(conv, add_generation_prompt=False)
    assert ours == ref.apply_chat_template(conv, tokenize=False) == "FILE1"


def test_no_template_means_none(bytelevel_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(bytelevel_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_folder(folder, Tokenizer.from_folder(folder)) is None


def test_raise_exception_is_invalid_argument(bytefallback_dir):
    tok, template, _ = _load(bytefallback_dir)
    with pytest.raises(InvalidArgument, match="only user and assistant"):
        template.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                        add_generation_prompt=True)


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    [{"role": "robot", "content": "x"}],
    [{"content": "x"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": {"text": "x"}}],
    [{"role": "user"}],
    [{"role": "user", "content": [{"type": "text", "text": 3}]}],
    [{"role": "user", "content": [{"type": "audio", "data": "x"}]}],
    [{"role": "user", "content": ["bare string part"]}],
    [{"role": "user", "content": "x", "name": object()}],
    ["not a dict"],
])
def test_bad_messages_are_refused(bytelevel_dir, messages):
    tok, template, _ = _load(bytelevel_dir)
    with pytest.raises(InvalidArgument):
        template.render(messages, add_generation_prompt=True)


def test_text_parts_join_for_a_string_template(bytelevel_dir):
    tok, template, ref = _load(bytelevel_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    assert template.render(parts, add_generation_prompt=False) == ref.apply_chat_template(joined, tokenize=False)


def test_image_part_refused_by_a_text_only_template(bytelevel_dir):
    tok, template, _ = _load(bytelevel_dir)
    with pytest.raises(Unsupported):
        template.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
                        add_generation_prompt=True)


def test_parts_template_gets_parts_with_images_as_type_image(bytelevel_dir, tmp_path):
    # A Qwen2-VL-style template iterates the parts; image parts reach it as {"type": "image"} only.
    source = ("{% for m in messages %}<{{ m.role }}>{% for p in m['content'] %}"
              "{% if p.type == 'image' %}<|vision_pad|>{% else %}{{ p.text }}{% endif %}{% endfor %}"
              "{% endfor %}")
    folder = _folder_with_template(bytelevel_dir, tmp_path, source)
    tok, template, ref = _load(folder)
    conv = [{"role": "user", "content": [{"type": "text", "text": "see"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    assert template.render(conv, add_generation_prompt=False) == ref.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"}]}], tokenize=False)
    assert normalize_messages(conv, parts_template=True)[0]["content"][1] == {"type": "image"}


def test_assistant_tool_call_without_content_is_allowed(bytelevel_dir, tmp_path):
    source = ("{% for m in messages %}{{ m.role }}:{{ m.tool_calls | tojson if m.tool_calls else m.content }};"
              "{% endfor %}")
    folder = _folder_with_template(bytelevel_dir, tmp_path, source)
    tok, template, ref = _load(folder)
    conv = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42"}]
    assert template.render(conv, add_generation_prompt=False) == ref.apply_chat_template(conv, tokenize=False)
