"""`mscclpp.ext`, where MSCCL++'s programs import the builder from."""

from .algorithm import AlgorithmCollection, AlgorithmCollectionBuilder

__all__ = ["AlgorithmCollection", "AlgorithmCollectionBuilder"]
