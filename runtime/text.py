"""Text in and out of a package: its own tokenizer and chat template."""

from __future__ import annotations

import logging
from pathlib import Path

from kvexport.contract.errors import KvexportError, PackageError

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
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns a growing list of ids into newly completed text, holding back a
    partial UTF-8 character until its bytes are all there."""

    def __init__(self, text: Text):
        self.text = text
        self.ids: list[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.text.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        new, self.shown = full[self.shown :], len(full)
        return new


def load_tokenizer(directory: Path | None) -> Text:
    if directory is None or not directory.is_dir():
        raise KvexportError("this package carries no tokenizer; pass token ids with --prompt-ids instead of --prompt")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise PackageError(f"tokenizer.dir {directory.name}: holds none of {', '.join(TOKENIZER_FILES)}")
    from transformers import AutoTokenizer  # only the tokenizer; no model code

    try:
        # a package's tokenizer is data: no code from it, nothing fetched
        return Text(AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False, local_files_only=True))
    except (OSError, ValueError) as e:  # what transformers raises for files it cannot read or parse
        raise PackageError(
            f"tokenizer.dir {directory.name}: not a tokenizer transformers can load ({type(e).__name__}: {str(e)[:200]})"
        ) from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
