"""Chat templates run in a sandbox with bounded work and memory (models/io/sandbox.py):
what renders renders as jinja2's own sandbox renders it; a template that fails or asks
for too much is one ChatTemplateError naming its file, in about a second at most, and
one line with exit 2 at `generate --chat` (tests/test_fuzz_cli.py)."""

import json
import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.families.common import ChatTemplateError
from models.io import folder_tokens, sandbox

CONTEXT = {"messages": [{"role": "user", "content": "Hi there"}], "add_generation_prompt": True}
CONTEXT |= {"bos_token": "<s>", "eos_token": "</s>"}

# templates in the styles of the Hub's (Llama 3's, ChatML's, Gemma's, Mistral's), using
# loops, namespaces, filters, methods, `~` and `+`, comparisons and slices
TEMPLATES = [
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}",
    "{% for m in messages %}{{'<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ (m.role == 'user') | string }}{{ m.content.upper()[:4] }}{{ loop.index }}"
    "{% endfor %}{{ ns.n * 3 }}{{ range(5) | join(',') }}{{ '%-6s|' % 'ab' }}"
    "{{ '{:>5}'.format('x') }}{{ messages | length }}{{ 2 ** 10 }}{{ 7 // 2 }}{{ -3 }}",
    "{% for i in range(40) %}{% for j in range(40) %}{{ (i * j) % 7 }}{% endfor %}{% endfor %}"
    "{{ ('a b ' * 20).split() | unique | list | tojson }}{{ 'x\\ny' | indent(3) }}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_what_renders_renders_as_jinjas_own_sandbox(template):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    want = env.from_string(template).render(**CONTEXT)
    assert sandbox.render(template, **CONTEXT) == want


# the templates and their kin: errors other than jinja's, and unbounded work
FAILING = {
    "{{ 1/0 }}": "ZeroDivisionError",
    "{{ 'a' + 1 }}": "TypeError",
    "{{ range(10**9) | list }}": "range()",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}": "RecursionError",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}": "does more",
    "{{ 'x' * 10**10 }}": "sandbox allows",
    "{{ [0] * 10**10 }}": "sandbox allows",
    "{{ 'x'.center(10**10) }}": "allows at most",
    "{{ 'x' | center(10**10) }}": "allows at most",
    "{{ '{:10000000000}'.format('x') }}": "str.format",
    "{{ '%10000000000s' % 'x' }}": "'%' formatting",
    "{{ ('x' * 100000).replace('', 'y' * 100000) }}": "replace()",
    "{{ (['x' * 100000] * 100000) | join }}": "|join()",
    "{{ ('\\n' * 100000) | indent(100000) }}": "|indent()",
    "{{ ('\\t' * 100000).expandtabs(100000) }}": "expandtabs()",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}": "an expression",
    "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
    "{% endfor %}": "bits",
    "{% for i in range(200000) %}{{ 'x' * 100 }}{% endfor %}": "the rendered text",
    "{% set s = 'x' * 1000000 %}{% for i in range(1000) %}{% if s == s ~ '' %}{% endif %}"
    "{% endfor %}": "characters handled",
    "{{ lipsum(n=2000, max=1000) }}": "generate_lorem_ipsum()",
    "{{ raise_exception('only user and assistant roles') }}": "only user and assistant",
    "{% for %}": "TemplateSyntaxError",
    "{{ messages[3].content }}": "UndefinedError",
}


def test_a_failing_or_unbounded_template_is_one_error_naming_its_file_within_a_second(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    slowest = 0.0
    for template, says in FAILING.items():
        (tmp_path / "chat_template.jinja").write_text(template)
        start = time.perf_counter()
        with pytest.raises(ChatTemplateError) as e:
            folder_tokens.apply_chat(tmp_path, "Hi")
        slowest = max(slowest, time.perf_counter() - start)
        message = str(e.value)
        assert f"{tmp_path}/chat_template.jinja" in message and says in message, template
        assert "\n" not in message, template
    assert slowest < 10  # about a second of work at most, on a loaded 2-core machine


def test_the_bound_is_the_documented_size_and_the_prompt_may_exceed_it(tmp_path):
    n = sandbox.MAX_SIZE
    assert len(sandbox.render(f"{{{{ 'x' * {n} }}}}")) == n
    with pytest.raises(sandbox.BudgetError, match=f"about {n + 1:,} characters"):
        sandbox.render(f"{{{{ 'x' * {n + 1} }}}}")
    long = "y" * (2 * n)  # a prompt longer than the bound is the user's: it renders
    assert sandbox.render("{{ messages[0].content }}", messages=[{"content": long}]) == long


def test_a_template_in_tokenizer_config_is_named_as_its_chat_template(tmp_path):
    config = {"chat_template": [{"name": "default", "template": "{{ 1/0 }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json's chat_template fails"):
        folder_tokens.apply_chat(tmp_path, "Hi")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(folder_tokens.DamagedFileError, match="chat_template: must be"):
        folder_tokens.apply_chat(tmp_path, "Hi")
