"""Tool use in chat data, against transformers: the sandbox renders what transformers'
own environment renders (its `tojson`, `{% break %}`, `strftime_now`), and a
conversation with tool definitions, an assistant's tool call and the tool's result
(roles `tool`, `function`, `ipython`) tokenizes as `apply_chat_template` does, the
weights its assistant mask: the call is learnt, the result is not."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from test_chat import folder, theirs  # noqa: E402, F401 (a fixture: the tokenizer folder)
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

from models.io import folder_tokens, sandbox  # noqa: E402
from models.training import chat, corpora, data  # noqa: E402

# Qwen2.5's tool layout (tools in the system turn, calls as <tool_call> JSON, results
# gathered in a user turn), with transformers' {% generation %} marks for the mask
QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}Be helpful.{% endif %}"
    "\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- for call in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>{% endgeneration %}\n"
    "{%- elif m.role in ['tool', 'function', 'ipython'] %}"
    "{%- if loop.first or messages[loop.index0 - 1].role not in ['tool', 'function', 'ipython'] %}"
    "<|im_start|>user{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role not in ['tool', 'function', 'ipython'] %}"
    "<|im_end|>\n{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "<Today's> & 'wind'",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]  # fmt: skip
CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
TALK = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "name": "weather", "content": '{"sky": "<clear>"}'},
    {"role": "function", "content": "12 C"},
    {"role": "assistant", "content": "Clear, 12 C."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome.", "tool_calls": []},
]


@pytest.mark.parametrize(
    "template",
    [
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(sort_keys=true) }}",
        "{% for i in range(9) %}{% if i == 2 %}{% continue %}{% endif %}{{ i }}"
        "{% if i > 4 %}{% break %}{% endif %}{% endfor %}",
        '{{ strftime_now("%d %b %Y") }}',  # Llama 3.2's today's date
    ],
    ids=["tojson", "loopcontrols", "strftime_now"],
)
def test_the_sandbox_renders_as_transformers(template):
    """Before: jinja2's tojson escaped <, >, &, ' and é and sorted the keys; break,
    continue and strftime_now were template errors."""
    x = {"b": "<é & 'q'>", "a": [1, {"z": None}]}
    want = render_jinja_template([[]], chat_template=template, x=x)[0][0]
    assert sandbox.render(template, x=x) == want


def test_tool_calls_and_results_are_tokenized_and_weighed_as_transformers(folder):  # noqa: F811
    path, tf_tok, _ = folder
    ours = chat.template(path)._replace(source=QWEN_TOOLS)
    tok = data.BPETokenizer(folder_tokens.read(path))
    for tools in (TOOLS, None):
        ids, weights = chat.encode(TALK, ours, tok, "x.jsonl:1", tools)
        out = tf_tok.apply_chat_template(
            TALK, tools=tools, chat_template=QWEN_TOOLS, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        np.testing.assert_array_equal(ids, out["input_ids"])
        np.testing.assert_array_equal(weights, np.asarray(out["assistant_masks"], np.float32))
        text = tok.decode(ids[weights > 0])
        assert '"city": "Zürich"' in text and "<clear>" not in text


def test_a_tool_line_reads_and_a_bad_one_names_its_line(tmp_path):
    file = tmp_path / "tools.jsonl"
    lines = [{"messages": TALK, "tools": TOOLS}, {"messages": TALK[:2]}]
    file.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = corpora.load(str(file))
    assert [(e.messages, e.tools) for e in got.items] == [(TALK, TOOLS), (TALK[:2], None)]
    bad = [
        ({"messages": TALK, "tools": {"weather": 1}}, "'tools' must be a list"),
        ({"messages": [TALK[0], {"role": "user", "tool_calls": [CALL]}, TALK[4]]},
         "message 1 must be an object with role and content"),
        ({"messages": [TALK[0], {"role": "assistant", "content": None}]},
         "message 1 must be an object with role and content|message 1's content must be text"),
    ]  # fmt: skip
    for line, message in bad:
        file.write_text(json.dumps(line) + "\n")
        with pytest.raises(data.DataError, match=f"{file}:1: ({message})"):
            corpora.load(str(file))


def test_the_default_template_writes_tools_and_calls_and_learns_the_calls():
    """Without a folder's template (a byte run): the tools in a system turn, each call's
    JSON in <tool_call> after the content; the weights cover the assistant's turns
    alone, as the layout written here in plain Python says."""
    tok = data.ByteTokenizer()
    ids, weights = chat.encode(TALK, chat.template(None), tok, "x.jsonl:1", TOOLS)
    call = f"<tool_call>\n{json.dumps(CALL, ensure_ascii=False)}\n</tool_call>"
    system = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in TOOLS)
    turns = [(m["role"], (m["content"] or "") + (call if m.get("tool_calls") else ""))
             for m in TALK]  # fmt: skip
    text = f"<|im_start|>system\n# Tools\n{system}<|im_end|>\n"
    text += "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns)
    assert tok.decode(ids) == text
    learnt = [c + "<|im_end|>" for r, c in turns if r == "assistant"]
    assert tok.decode(ids[weights > 0]) == "".join(learnt)


@pytest.mark.parametrize(
    "date, want", [("2025-01-02", "02 Jan 2025 00:00"), ("none", "26 Jul 2024")]
)
def test_a_runs_date_is_what_strftime_now_renders(date, want):
    """A training run renders its chat data on the date it records (run.json's
    chat_date), whatever day it resumes; 'none' as before the sandbox had a clock
    (Llama 3.x's templates then fall back to their own date)."""
    source = (
        '{%- if strftime_now is defined %}{{ strftime_now("%d %b %Y %H:%M") }}'
        "{%- else %}26 Jul 2024{%- endif %}"
    )
    t = chat.Template(source, "a Llama 3.x-style template", date=date)
    assert chat.render(t, [], False, "x.jsonl:1") == want
