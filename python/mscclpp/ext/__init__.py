"""`mscclpp.ext`, MSCCL++'s extensions: the algorithm builder (where MSCCL++'s programs import it
from) and `mscclpp.ext.ep`, expert-parallel MoE dispatch and combine with DeepEP's API. `ep` is
imported on its own (`from mscclpp.ext import ep`) because it needs torch and this package does
not."""

from ..algorithm import AlgorithmCollection, AlgorithmCollectionBuilder

__all__ = ["AlgorithmCollection", "AlgorithmCollectionBuilder"]
