"""The portable backend: each method's torch.export graph, run by PyTorch's
own kernels."""

from kvexport.partitioners.registry import Backend, BackendOptions, register_backend


def _partitioners(options: BackendOptions) -> list:
    from kvexport.partitioners.portable.partitioner import PortablePartitioner

    return [PortablePartitioner()]


register_backend(Backend("portable", "PyTorch's own kernels run each method's graph", _partitioners))
