"""Package strings made safe to print. A package is untrusted: a method name,
a metadata value or a file name may hold terminal escapes ("\\x1b]0;...\\x07"
retitles the window, "\\x1b[2J" clears it, "\\r" overwrites the line, a
newline forges a line of `validate`'s verdict), so every line that shows one
is escaped before it reaches a terminal. JSON output needs nothing more:
`json.dumps` writes every control character as \\uXXXX."""

from __future__ import annotations

import unicodedata

# control (Cc), format (Cf: bidi overrides, zero widths), line and paragraph
# separators: all that moves the cursor, hides text or reorders it; and lone
# surrogates (JSON may hold "\ud800"), which no terminal encoding can write
_UNSAFE = frozenset(("Cc", "Cf", "Zl", "Zp", "Cs"))


def escape(text: object) -> str:
    """str(text) with every unsafe character written as a Python escape
    (\\x1b, \\n, \\u202e); the rest, tabs included, unchanged."""
    text = str(text)
    if text.isprintable():  # the common case, in C
        return text
    return "".join(_escaped(c) if c != "\t" and unicodedata.category(c) in _UNSAFE else c for c in text)


def escape_lines(text: str) -> str:
    """A block of lines, each escaped: its newlines stay (a message's own, or
    generated text's), any other control character is shown."""
    return "\n".join(escape(line) for line in text.split("\n"))


def _escaped(c: str) -> str:
    code = ord(c)
    if code < 0x100:
        return {"\n": "\\n", "\r": "\\r"}.get(c, f"\\x{code:02x}")
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
