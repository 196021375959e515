"""Text in and out of a package: its own tokenizer and chat template.

The tokenizer is loaded from a private copy of the package's allowlisted
tokenizer files (contract/tokenizer_files.py: read once, never through a
link, matched to the manifest's digests, a config naming no path or code),
and its chat template is rendered with bounded work, time and output
(contract/chat_template.py) instead of by transformers."""

from __future__ import annotations

import logging
import os
import tempfile

from kvexport.contract.chat_template import render_chat
from kvexport.contract.errors import KvexportError, PackageError
from kvexport.contract.package import PackageReader
from kvexport.contract.tokenizer_files import read_tokenizer_files

log = logging.getLogger(__name__)


class Text:
    """The package's tokenizer: prompts to ids, ids to streamed text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if chat and self.has_chat_template:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation as the prompt the model continues as the assistant."""
        text = self.apply_chat_template(messages)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The text transformers' apply_chat_template(tokenize=False) gives,
        rendered within contract.chat_template's limits."""
        try:
            template = self.tokenizer.get_chat_template()  # picks "default" of a dict of templates
        except ValueError as e:
            raise PackageError(f"tokenizer: no usable chat template ({str(e)[:200]})") from None
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.tokenizer.special_tokens_map, name="the package's chat template")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns a growing list of ids into newly completed text, holding back a
    partial UTF-8 character until its bytes are all there.

    Each push decodes a short window (the ids since the last text shown, and
    the one before them, which fixes a tokenizer's leading space), not the
    whole list: the cost of a token does not grow with the output."""

    def __init__(self, text: Text):
        self.text = text
        self.ids: list[int] = []
        self.prefix = 0  # the window starts here
        self.read = 0  # ids before this one have been shown

    def push(self, token: int) -> str:
        self.ids.append(token)
        shown = self.text.decode(self.ids[self.prefix : self.read])
        window = self.text.decode(self.ids[self.prefix :])
        if window.endswith("\ufffd") or len(window) <= len(shown):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(shown) :]


class StopMatcher:
    """Cuts generated text at the first of `stops`, which may span tokens:
    text that could still be the start of a stop string is held back."""

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show, whether a stop string ended the output)."""
        if not self.stops:
            return text, False
        buffer = self.held + text
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buffer[: min(hits)], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buffer)), 0, -1)
                    if buffer.endswith(s[:k])), default=0)
        self.held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def load_tokenizer(reader: PackageReader) -> Text:
    """The package's tokenizer, from a private copy (a 0700 folder that is
    removed afterwards) of exactly the bytes contract.tokenizer_files read
    and checked: transformers opens nothing of the package's folder, and
    nothing outside it."""
    files = read_tokenizer_files(reader)
    if not files:
        raise KvexportError("this package carries no tokenizer; pass token ids with --prompt-ids instead of --prompt")
    from transformers import AutoTokenizer  # only the tokenizer; no model code

    with tempfile.TemporaryDirectory(prefix="kvexport-tokenizer-") as private:  # mkdtemp: mode 0700
        for name, data in files.items():
            fd = os.open(os.path.join(private, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            # a package's tokenizer is data: no code from it, nothing fetched
            return Text(AutoTokenizer.from_pretrained(private, trust_remote_code=False, local_files_only=True))
        except (OSError, ValueError, TypeError, KeyError) as e:  # what transformers raises for files it cannot use
            raise PackageError(
                f"{reader.path}: tokenizer: not a tokenizer transformers can load ({type(e).__name__}: {str(e)[:200]})"
            ) from None
