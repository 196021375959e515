"""Typed errors. Every error a user can cause is a KvexportError whose message
says what was wrong and how to fix it; the CLI prints it without a traceback."""


class KvexportError(Exception):
    """Base of every error kvexport raises on purpose."""


class SpecError(KvexportError):
    """An export request (flags, recipe, overrides) is invalid."""


class ModelError(KvexportError):
    """A model source cannot be found, loaded or served by the contract."""


class ExportError(KvexportError):
    """Tracing or writing a package failed."""


class PackageError(KvexportError):
    """A package is missing, damaged, or breaks its contract."""


class RuntimeRefusal(KvexportError):
    """The runtime refused a request before changing any state."""


class CapacityError(RuntimeRefusal):
    """Too few free cells, sessions or context positions for a request."""


class TrustStoreError(KvexportError):
    """The trust store (trusted package digests) cannot be read or written."""
