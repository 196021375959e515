"""The reference runtime: runs kvexport packages as a serving runtime would.

    from kvexport.runtime import load
    rt = load("pkg")                    # selects the I/O manager by contract
    s = rt.new_session()
    [logits] = rt.step([StepEntry(s, [1, 2, 3])])
"""

from kvexport.runtime import offgraph as _offgraph  # noqa: F401  (registers offgraph_kv v1)
from kvexport.runtime import single_sequence as _single_sequence  # noqa: F401  (registers ingraph_kv v1 and hf_static v1)
from kvexport.contract.errors import KvexportError, PackageError, RuntimeRefusal
from kvexport.runtime.generate import generate
from kvexport.runtime.loader import IOManager, LoadedPackage, load, register_io_manager, registered_contracts
from kvexport.runtime.offgraph import OffgraphKVManager, Session, StepEntry
from kvexport.contract.sampler import SamplingConfig, sample, sample_argmax
from kvexport.runtime.single_sequence import HFStaticManager, IngraphKVManager, SingleSequenceManager

__all__ = [
    "IOManager",
    "KvexportError",
    "LoadedPackage",
    "OffgraphKVManager",
    "PackageError",
    "RuntimeRefusal",
    "SamplingConfig",
    "Session",
    "StepEntry",
    "HFStaticManager",
    "IngraphKVManager",
    "SingleSequenceManager",
    "generate",
    "load",
    "register_io_manager",
    "registered_contracts",
    "sample",
    "sample_argmax",
]
