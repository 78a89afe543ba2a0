"""A jinja2 sandbox with bounded work and memory, for the chat templates of Hugging
Face folders (code from a downloaded folder, run on the user's machine).

jinja2's ImmutableSandboxedEnvironment keeps a template away from Python's internals,
but not from the CPU or memory: two nested `range(100000)` loops render for hours and
`{{ 'x' * 10**10 }}` allocates 10 GB. `Bounded` adds, deterministically (no clock, no
thread, no subprocess):

- a budget of OPS operations: each call, filter, operator, attribute or item access,
  comparison, output and loop iteration is one (loops are counted by rewriting each
  `for`'s iterable through `Bounded.counted` before the template is compiled);
- a budget of CHARS characters (or items) handled: each operation also spends the
  sizes of its operands and result, so the time a template takes is bounded whatever
  it does, and so is what it holds alive (it cannot keep more than it made);
- no value larger than `max_size` characters or items (a 64k-bit int), checked after
  every operation, and before the ones whose result can outgrow their operands by a
  factor the template chooses: `*`, `**`, `%`, int arguments of calls and filters,
  str.replace / expandtabs / join / format, the join, replace, indent, sum and format
  filters; ranges of at most `max_size` items;
- at most `max_size` characters rendered.

The environment is transformers' (`_compile_jinja_template`): trim_blocks and
lstrip_blocks, `{% break %}` and `{% continue %}` (jinja2.ext.loopcontrols),
`{% generation %}`, `raise_exception`, `strftime_now(format)` (the local clock's time,
as transformers' Llama 3.x templates read today's date), and transformers' `tojson`
(json.dumps: unescaped `<`, `>`, `&`, `'` and non-ASCII, keys in their order; jinja2's
own escapes them for HTML and sorts the keys, so a tool call would render otherwise).

`render` turns every failure (a jinja error, a budget spent, or what a sandboxed call
raises: ZeroDivisionError, TypeError, RecursionError...) into one `TemplateFailure`.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

from jinja2 import Undefined, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

OPS = 1_000_000  # about a second of sandboxed Python
CHARS = 100_000_000  # characters or items handled in all (a few hundred MB at most)
MAX_SIZE = 1 << 20  # a value's characters or items, unless the context is larger
MAX_BITS = 1 << 16  # an int's bits
_DIGITS = re.compile(r"\d+")


class TemplateFailure(Exception):
    """A template that fails or exceeds its budget; the message is one line."""


class BudgetError(TemplateFailure):
    """A template that asked for more work or memory than the sandbox allows."""


def size(value) -> int:
    """Characters or items of a value (an int: its bytes); 0 for other values."""
    if isinstance(value, str | bytes | list | tuple | dict | set | frozenset | range):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


class _Counting(NodeTransformer):
    """Rewrite a parsed template so that the work the sandbox's hooks never see is
    counted: each loop's iterable, each output expression, each comparison's
    operands and each `~` concatenation go through `Bounded.counted`."""

    def _count(self, node):
        return nodes.Call(nodes.EnvironmentAttribute("counted"), [node], [], None, None)

    def visit_For(self, node):
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.EnvironmentAttribute("loop"), [node.iter], [], None, None)
        return node

    def visit_Output(self, node):
        node = self.generic_visit(node)
        node.nodes = [
            n if isinstance(n, nodes.TemplateData) else self._count(n) for n in node.nodes
        ]
        return node

    def visit_Compare(self, node):
        node = self.generic_visit(node)
        node.expr = self._count(node.expr)
        for op in node.ops:
            op.expr = self._count(op.expr)
        return node

    def visit_Concat(self, node):
        return self._count(self.generic_visit(node))


class Bounded(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with budgets of operations, characters handled,
    value sizes and output (see the module's docstring); one per template (`_compiled`),
    its budgets set afresh by each `render`."""

    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})
    intercepted_unops = frozenset({"+", "-"})

    def __init__(self, max_size: int = MAX_SIZE, **options):
        super().__init__(**options)
        self.max_size, self.ops, self.chars = max_size, 0, 0
        self.globals["range"] = self.range
        self.globals["strftime_now"] = strftime_now
        self.filters["tojson"] = tojson
        self.filters = {k: self._bounded_filter(k, f) for k, f in self.filters.items()}

    # --- the budgets --------------------------------------------------------------
    def spend(self, *values) -> None:
        """One operation over `values` (its operands and result)."""
        self.ops += 1
        self.chars += sum(map(size, values))
        if self.ops > OPS or self.chars > CHARS:
            raise BudgetError(
                f"the template does more than the sandbox allows ({OPS:,} operations, "
                f"{CHARS:,} characters handled)"
            )

    def fits(self, estimate: int, what: str) -> None:
        if estimate > self.max_size:
            raise BudgetError(
                f"{what} would make a value of about {estimate:,} characters or items; the "
                f"sandbox allows {self.max_size:,}"
            )

    def checked(self, value, what: str = "a value"):
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise BudgetError(
                f"{what} is an int of {value.bit_length():,} bits (at most {MAX_BITS:,})"
            )
        self.fits(size(value), what)
        return value

    def check_arguments(self, name: str, args, kwargs) -> None:
        """Refuse a call whose int arguments or known growth exceed max_size."""
        for v in (*args, *kwargs.values()):
            if isinstance(v, int) and abs(v) > self.max_size:
                shown = f"{v:,}" if v.bit_length() < 64 else f"an int of {v.bit_length():,} bits"
                raise BudgetError(
                    f"{name}() given {shown}; the sandbox allows at most {self.max_size:,}"
                )
        grow = _GROWTH.get(name)
        if grow is not None and (args or kwargs):
            self.fits(grow(*args, **kwargs), f"{name}()")

    # --- the hooks jinja2's sandbox calls -----------------------------------------
    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own names)
        name = getattr(__obj, "__name__", "a call")
        bound = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if bound is __self:  # counted() and loop(), which `_Counting` inserts, and range()
            name = {"counted": "an expression", "loop": "a loop"}.get(name, name)
        elif isinstance(bound, str):  # a str method: the string is its first operand
            __self.check_arguments(name, (bound, *args), kwargs)
        else:
            __self.check_arguments(name, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        __self.spend(*args, *kwargs.values(), result)
        return __self.checked(result, name if bound is __self else f"{name}()")

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(n, int) and isinstance(seq, str | list | tuple):
                self.fits(len(seq) * n, f"{operator!r}")
            elif isinstance(n, int) and isinstance(seq, int):
                self.checked(1 << min(n.bit_length() + seq.bit_length(), MAX_BITS + 1), "'*'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            self.checked(1 << min(left.bit_length() * right, MAX_BITS + 1), "'**'")
        elif operator == "%" and isinstance(left, str):
            self.fits(_formatted(left, right), "'%' formatting")
        result = super().call_binop(context, operator, left, right)
        self.spend(left, right, result)
        return self.checked(result, f"{operator!r}")

    def call_unop(self, context, operator, arg):
        self.spend(arg)
        return super().call_unop(context, operator, arg)

    def getattr(self, obj, attribute):
        result = super().getattr(obj, attribute)
        self.spend(result)
        return result

    def getitem(self, obj, argument):
        result = super().getitem(obj, argument)
        self.spend(result)  # a slice copies
        return result

    # --- what the rewritten template and the globals call --------------------------
    def counted(self, value):
        """An expression's value (what `_Counting` wraps): `call` spends and checks it,
        as it does every call's."""
        return value

    def loop(self, iterable):
        """A loop's iterable, each item one operation."""
        for item in iterable:
            self.spend(item)
            yield item

    def range(self, *args):
        result = range(*args)
        self.fits(len(result), "range()")
        return result

    def _bounded_filter(self, name: str, f):
        # a filter marked pass_context / pass_environment gets that first
        skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

        @functools.wraps(f)
        def bounded(*args, **kwargs):
            self.check_arguments(f"|{name}", args[skip:], kwargs)
            result = f(*args, **kwargs)
            self.spend(*args[skip:], result)
            return self.checked(result, f"the {name} filter")

        return bounded

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def check(*args, **kwargs):
            self.fits(_formatted(value.__self__, (args, kwargs)), "str.format")
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(check, wrapped)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson` filter: json.dumps, not jinja2's HTML-safe one."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def strftime_now(format: str) -> str:
    """transformers' `strftime_now` global: the local time now, formatted."""
    return datetime.now().strftime(format)


def clock(date: str | None) -> dict:
    """The render context's `strftime_now` for `date`: {} (today's, the global) for None;
    midnight of an ISO date's day; undefined for "none" (a template's `strftime_now is
    defined` false, as before the sandbox had it)."""
    if date is None:
        return {}
    if date == "none":
        return {"strftime_now": Undefined(name="strftime_now")}
    day = datetime.fromisoformat(date)
    return {"strftime_now": lambda format: day.strftime(format)}


def _formatted(fmt: str, args) -> int:
    """An upper bound of the length of `fmt` formatted with `args` (`%` or str.format):
    every run of digits in it may be a field's width or precision."""
    widths = sum(min(int(d[:8]), MAX_SIZE * 16) for d in _DIGITS.findall(fmt))
    return len(fmt) + widths + _deep_size(args)


def _deep_size(value) -> int:
    if isinstance(value, dict):
        return sum(_deep_size(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_deep_size(v) for v in value)
    return max(size(value), 20)  # a number's digits


def _joined(items, sep) -> int:
    if not isinstance(items, str | list | tuple | dict):
        return 0  # a generator: its items are each checked where they are made
    return sum(max(size(x), 20) for x in items) + size(sep) * len(items)


def _str_join(sep, items=(), *args, **kwargs) -> int:
    return _joined(items, sep)


def _filter_join(items, d="", *args, **kwargs) -> int:
    return _joined(items, d)


def _replace(s, old="", new="", *args, **kwargs) -> int:
    if not all(isinstance(x, str) for x in (s, old, new)):
        return 0
    return len(s) + (len(s) + 1 if old == "" else s.count(old)) * len(new)


def _indent(s, width=4, *args, **kwargs) -> int:
    return size(s) + (str(s).count("\n") + 1) * (width if isinstance(width, int) else size(width))


def _expandtabs(s, tabsize=8, *args, **kwargs) -> int:
    return size(s) + str(s).count("\t") * (tabsize if isinstance(tabsize, int) else 0)


def _nodes(value, depth: int = 1) -> tuple[int, int]:
    """(items and keys, deepest nesting) of a JSON-like value."""
    if isinstance(value, dict | list | tuple):
        items = value.values() if isinstance(value, dict) else value
        inner = [_nodes(v, depth + 1) for v in items]
        return len(value) + sum(n for n, _ in inner), max((d for _, d in inner), default=depth)
    return 1, depth


def _tojson(x, ensure_ascii=False, indent=None, separators=None, *args, **kwargs) -> int:
    # escapes (\uXXXX: 6 per character), then per item a newline, the indent per level
    # and the separators
    n, depth = _nodes(x)
    width = indent if isinstance(indent, int) else size(indent)
    seps = sum(map(size, separators)) if isinstance(separators, list | tuple) else 4
    return 6 * _deep_size(x) + n * (1 + max(width, 0) * depth + seps)


def _strftime(fmt="", *args, **kwargs) -> int:
    return 32 * size(fmt)  # a directive's two characters become at most ~30 (%c)


def _sum(items, *args, **kwargs) -> int:
    ok = isinstance(items, list | tuple)
    return sum(size(x) for x in items) if ok else 0


def _lipsum(n=5, html=True, min=20, max=100, *args, **kwargs) -> int:
    # paragraphs of at most `max` words of at most a dozen characters
    return n * max * 12 if isinstance(n, int) and isinstance(max, int) else 0


def _format(fmt, *args, **kwargs) -> int:
    return _formatted(fmt, (args, kwargs)) if isinstance(fmt, str) else 0


# the calls whose result can outgrow their operands by a factor the template picks:
# name (a str method's or "|filter") -> an upper bound of the result's size
_GROWTH = {
    "join": _str_join,
    "|join": _filter_join,
    "replace": _replace,
    "|replace": _replace,
    "|indent": _indent,
    "expandtabs": _expandtabs,
    "|sum": _sum,
    "|format": _format,
    "|tojson": _tojson,
    "strftime_now": _strftime,
    "generate_lorem_ipsum": _lipsum,  # the lipsum() global
}


class Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks an assistant's
    text for its mask (`return_assistant_tokens_mask`): rendered as its body (the
    masks of chat data are found by rendering incrementally, models/training/chat.py)."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    """(its Bounded environment, the template compiled in it, loops counted): compiling
    takes most of a render's time, and chat data renders one template thousands of
    times (models/training/chat.py)."""
    extensions = [Generation, loopcontrols]
    env = Bounded(MAX_SIZE, trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.globals["raise_exception"] = _raise
    return env, env.from_string(_Counting().visit(env.parse(source)))


def render(source: str, max_size: int = MAX_SIZE, **context) -> str:
    """`source` rendered with `context` in a `Bounded` sandbox (trim_blocks and
    lstrip_blocks, as transformers renders chat templates); TemplateFailure (one
    line) for any failure. Values may be as large as max_size, or 4x the context's."""
    try:
        env, template = _compiled(source)
        # the budgets start afresh for every render (the compiled template is reused)
        env.max_size, env.ops, env.chars = max(max_size, 4 * _deep_size(context)), 0, 0
        out, n = [], 0
        for piece in template.generate(**context):
            n += len(piece)
            env.fits(n, "the rendered text")
            out.append(piece)
        return "".join(out)
    except TemplateFailure:
        raise
    except Exception as e:  # what any sandboxed call may raise (RecursionError too)
        line = " ".join(str(e).split())
        raise TemplateFailure(f"{type(e).__name__}: {line}" if line else type(e).__name__) from None


def _raise(message):
    """The `raise_exception(message)` of transformers' chat templates."""
    raise TemplateFailure(f"the template raises: {message}")
