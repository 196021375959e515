"""The package format and its contracts: what a kvexport package holds and
what every reader may rely on. The exporter writes packages with this code,
and the runtime, `validate` and `inspect` read them with it, so the three
cannot drift apart.

It imports nothing else of kvexport's: the exporter, passes and
partitioners lean on it, and so does the runtime.

    errors.py         typed errors (KvexportError and its children)
    manifest.py       the manifest's envelope, shared specs and checks, the
                      registry of contract checks, and the lists of
                      contracts, dtypes and backends
    offgraph_kv.py    the offgraph_kv contract: metadata, methods, input order
    single_sequence.py  the ingraph_kv and hf_static contracts
    package.py        PackageWriter / PackageReader: the file layout
    confined_io.py    opening a package's files once, inside it, never by a link
    program_check.py  what a stored program may hold, checked before torch reads it
    op_allowlist.py   the exact operator overloads a program may call, and why each is safe
    tokenizer_files.py  the files a tokenizer folder may hold, read and checked
    chat_template.py  chat templates rendered with bounded work
    display.py        package strings escaped for a terminal
    torch_compat.py   torch's program (de)serializer, used safely
    step_width.py     the step-width declaration and its check
    sampler.py        the samplers the package's methods and hosts share
    trust.py          the trust store for native code
    validate.py       `kvexport validate`
    inspect.py        `kvexport inspect`
"""

from kvexport.contract import offgraph_kv as _offgraph_kv  # noqa: F401,E402  (registers offgraph_kv v1)
from kvexport.contract import single_sequence as _single_sequence  # noqa: F401,E402  (registers ingraph_kv and hf_static v1)
