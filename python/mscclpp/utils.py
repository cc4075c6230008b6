"""Conversions between PyTorch's types and the runtime's (MSCCL++'s `mscclpp.utils`)."""

from ._types import DataType

# By name, so this module imports (and is testable) without torch.
_TORCH_TO_MSCCLPP = {
    "float16": DataType.float16,
    "float32": DataType.float32,
    "bfloat16": DataType.bfloat16,
    "float64": DataType.float64,
    "int8": DataType.int8,
    "uint8": DataType.uint8,
    "int32": DataType.int32,
    "uint32": DataType.uint32,
    "int64": DataType.int64,
    "uint64": DataType.uint64,
    "float8_e4m3fn": DataType.float8_e4m3,
    "float8_e5m2": DataType.float8_e5m2,
    "float8_e4m3fnuz": DataType.float8_e4m3fnuz,
}


def torch_dtype_to_mscclpp_dtype(dtype) -> DataType:
    """The DataType of a torch dtype (`torch.bfloat16` -> `DataType.bfloat16`); ValueError if none."""
    name = str(dtype).replace("torch.", "")
    try:
        return _TORCH_TO_MSCCLPP[name]
    except KeyError:
        raise ValueError(
            f"torch dtype {dtype} has no mscclpp DataType (supported: {', '.join(sorted(_TORCH_TO_MSCCLPP))})"
        ) from None
