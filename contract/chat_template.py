"""Chat templates rendered with bounded work, time and output.

A chat template is package text that runs. transformers renders it in
jinja2's ImmutableSandboxedEnvironment, which bounds what a template may
*name* (no attribute starting with `_`, no mutation of lists and dicts),
not what it may *do*: `{{ 'abc ' * 10**9 }}` (37 bytes) allocates past
8 GiB, and two nested `range(100000)` loops spin for hours.

`render_chat` renders it the way transformers' `apply_chat_template` does
(same options, globals, filter and variables, so the same text), in an
environment that checks work before it is done:

- every operator, call, filter and `~` first checks its operands: no value
  (a string, list or dict, counted deeply) larger than `max_chars`; no step
  whose work exceeds `max_work`: a call's two largest operands multiplied
  (`'ab'.ljust(n)`, `s.replace(a, b)`, `'x' * n`), a format string's
  length times its widest field (`'%999999999s' % 1`); no integer past
  `max_int_bits` (`10**10**9`);
- every loop counts its iterations against `max_steps`;
- every check also reads the clock against `max_seconds`;
- the output streams, and stops past `max_chars`.

A template that passes a limit is a TemplateLimitError (a PackageError)
naming the template and the limit.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Iterator

from kvexport.contract.errors import PackageError


@dataclass(frozen=True)
class Limits:
    max_chars: int = 1 << 22  # any value, and the rendered prompt: 4 M characters (~1 M tokens)
    max_work: int = 1 << 26  # characters one step may produce or scan
    max_int_bits: int = 1 << 12
    max_steps: int = 1 << 20  # loop iterations in one render
    max_seconds: float = 2.0
    max_template_chars: int = 1 << 20  # compiling costs ~100x a template's size; real ones are a few kB


class TemplateLimitError(PackageError):
    """A chat template passed one of the render's limits."""


# names the bounded environment adds to a template's globals (the parse rewrites loops and `~` to call them)
_LOOP, _CONCAT = "kvexport_bounded_loop", "kvexport_bounded_concat"
# an integer result's bits, bounded before it is computed
_INT_BITS = {"*": lambda a, b: a.bit_length() + b.bit_length(), "**": lambda a, b: b * max(a.bit_length(), 1)}


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, Any] | None = None, name: str = "chat template",
                limits: Limits = Limits(), **variables: Any) -> str:
    """`template` applied to `messages` as transformers' apply_chat_template
    renders it (tokenize=False), with `special_tokens` (bos_token, eos_token,
    ...) among the variables; raises TemplateLimitError past a limit and
    PackageError for a template that fails."""
    import jinja2

    if len(template) > limits.max_template_chars:
        raise TemplateLimitError(f"{name}: {len(template)} characters, more than a chat template holds ({limits.max_template_chars})")
    env = _environment(limits, name)
    try:
        compiled = env.from_string(template)
        context = {**(special_tokens or {}), **variables}
        chunks = compiled.generate(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **context)
        return env.budget.join_output(chunks)
    except TemplateLimitError:
        raise
    except (jinja2.TemplateError, ArithmeticError, TypeError, ValueError, LookupError, RecursionError, MemoryError,
            SyntaxError) as e:
        # raise_exception() in the template, a syntax error (jinja's, or Python's on what jinja generated
        # from deep nesting), a sandbox refusal, a failing operation
        raise PackageError(f"{name}: does not render ({type(e).__name__}: {str(e)[:200]})") from None


class _Budget:
    """The work, steps and time one render has left."""

    def __init__(self, limits: Limits, name: str):
        self.limits, self.name = limits, name
        self.steps = 0
        self.deadline = time.monotonic() + limits.max_seconds

    def refuse(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(f"{self.name}: {what}; a chat template renders a prompt, not this much work: fix the template")

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.refuse(f"ran past {self.limits.max_seconds:g} s")

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise self.refuse(f"loops ran past {self.limits.max_steps} iterations")
        if self.steps % 256 == 0:
            self.tick()

    def check(self, values: Iterable[Any], what: str) -> None:
        """Each value within max_chars; the two largest sizes (an integer's
        is its magnitude) multiplied within max_work."""
        self.tick()
        sizes = sorted(self.size(v, what) for v in values)
        if len(sizes) >= 2:
            self.work(sizes[-1] * max(sizes[-2], 1), what)

    def work(self, steps: int, what: str) -> None:
        if steps > self.limits.max_work:
            raise self.refuse(f"{what} would take about {steps} steps, more than {self.limits.max_work}")

    def formatting(self, fmt: str, values: Any, what: str) -> None:
        """Each field of `fmt` writes at most its width or all of `values`."""
        self.tick()
        widths = [int(n) for n in re.findall(r"\d+", fmt)]  # widths and precisions
        self.work(len(fmt) * max(self.size(values, what), *widths, 1), what)

    def integers(self, operator: str, left: int, right: int) -> None:
        self.tick()
        if operator in _INT_BITS and _INT_BITS[operator](abs(left), abs(right)) > self.limits.max_int_bits:
            raise self.refuse(f"{operator!r} would make an integer past {self.limits.max_int_bits} bits")

    def size(self, value: Any, what: str) -> int:
        """A value's size: characters, items (counted through nesting, shared
        ones each time), or an integer's magnitude; refused past max_chars."""
        cap = self.limits.max_chars
        if isinstance(value, int) and not isinstance(value, bool):
            if value.bit_length() > self.limits.max_int_bits:
                raise self.refuse(f"{what}: an integer of {value.bit_length()} bits, more than {self.limits.max_int_bits}")
            return abs(value)  # a count or width: bounded as work (times what it repeats), not as a size
        total, stack = 0, [value]
        while stack and total <= cap:
            item = stack.pop()
            if isinstance(item, (str, bytes)):
                total += len(item)
            elif isinstance(item, (list, tuple, set, frozenset)):
                total += len(item)
                stack.extend(item)
            elif isinstance(item, dict):
                total += len(item)
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                total += 1
        if total > cap:
            raise self.refuse(f"{what}: a value of more than {cap} characters or items")
        return total

    def join_output(self, chunks: Iterator[str]) -> str:
        out, length = [], 0
        for chunk in chunks:
            length += len(chunk)
            if length > self.limits.max_chars:
                raise self.refuse(f"renders more than {self.limits.max_chars} characters")
            out.append(chunk)
            self.tick()
        return "".join(out)


def _environment(limits: Limits, name: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    budget = _Budget(limits, name)

    class Generation(Extension):
        """transformers' `{% generation %}` tag, which marks the assistant's
        text for training masks: here it renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Bounded(NodeTransformer):
        """Rewrites each loop's iterable and each `~` into calls that count."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = nodes.Call(nodes.Name(_LOOP, "load"), [node.iter], [], None, None).set_lineno(node.lineno)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return nodes.Call(nodes.Name(_CONCAT, "load"), list(node.nodes), [], None, None).set_lineno(node.lineno)

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def _parse(self, source, name, filename):
            return Bounded().visit(super()._parse(source, name, filename))

        def call_binop(self, context, operator, left, right):
            what = f"{operator!r}"
            if isinstance(left, int) and isinstance(right, int):
                budget.integers(operator, left, right)
            elif operator == "%" and isinstance(left, str):
                budget.formatting(left, right, what)
            elif operator == "+":
                budget.size((left, right), what)  # the sum is the result
            else:  # a sequence repeated, or numbers
                budget.check((left, right), what)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):
            if __obj is loop or __obj is concat:  # they count for themselves
                return super().call(__context, __obj, *args, **kwargs)
            target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            receiver = getattr(target, "__self__", None)
            receiver = receiver if isinstance(receiver, (str, list, tuple, dict)) else None
            what = f"calling {getattr(target, '__name__', 'a function')!s:.40}"
            if isinstance(receiver, str) and getattr(target, "__name__", "") in ("format", "format_map"):
                budget.formatting(receiver, (args, kwargs), what)
            else:
                budget.check((receiver, *args, *kwargs.values()), what)
            return super().call(__context, __obj, *args, **kwargs)

    def loop(iterable):
        for item in iterable:
            budget.step()
            yield item

    def concat(*parts):
        budget.size(parts, "'~'")
        return "".join(map(str, parts))

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.budget = budget  # what render_chat streams the output through
    env.filters = {key: _bounded_filter(fn, key, budget) for key, fn in env.filters.items()}
    env.filters["tojson"] = _bounded_filter(_tojson, "tojson", budget)
    env.globals.update({
        _LOOP: loop, _CONCAT: concat, "raise_exception": _raise_exception, "strftime_now": _strftime_now,
        "dict": _TemplateDict(), "namespace": _namespace_class(budget, jinja2),
    })
    return env


def _bounded_filter(fn, key: str, budget: _Budget):
    """A filter whose arguments are checked first (`'a'|center(10**9)`,
    `'%999999999s'|format(1)`, `x|indent(n)`)."""
    import functools

    # a filter marked pass_context (or _environment, _eval_context) gets that first, then its value
    skip = 0 if getattr(fn, "jinja_pass_arg", None) is None else 1

    @functools.wraps(fn)  # keeps jinja's pass_* mark
    def checked(*args, **kwargs):
        values, what = args[skip:], f"the filter {key}"
        if key == "format" and values and isinstance(values[0], str):
            budget.formatting(values[0], (values[1:], kwargs), what)
        else:
            budget.check((*values, *kwargs.values()), what)
        return fn(*args, **kwargs)

    return checked


# What transformers' _compile_jinja_template gives a template (transformers 5.x):


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # not jinja's tojson, which escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` without the class itself (no type-hackery through it)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class(budget: _Budget, jinja2):
    class Namespace(jinja2.utils.Namespace):
        """A namespace that stores no `_` name (transformers' rule) and no
        value past the limits: `ns.s = ns.s ~ ns.s` in a loop doubles."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key, value in attrs.items():
                Namespace._check(key, value)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            Namespace._check(key, value)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key, value):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {key!r}."
                )
            budget.size(value, f"namespace.{key}")

    return Namespace
