"""Element types, reduction operations and result codes, spelled as MSCCL++'s Python API spells
them.

Each DataType, ReduceOp and PacketType member's value is the runtime's own name for it, which is
what crosses into the native layer; CommResult's are MSCCL++'s integer codes.
"""

import enum


class DataType(enum.Enum):
    int32 = "i32"
    uint32 = "u32"
    float16 = "f16"
    float32 = "f32"
    bfloat16 = "bf16"
    float8_e4m3 = "fp8_e4m3"
    float8_e5m2 = "fp8_e5m2"
    # Types the runtime has beyond MSCCL++'s list.
    float64 = "f64"
    int8 = "i8"
    uint8 = "u8"
    int64 = "i64"
    uint64 = "u64"
    float8_e4m3fnuz = "fp8_e4m3fnuz"
    float8_e4m3b15 = "fp8_e4m3b15"

    @property
    def size(self) -> int:
        """Bytes per element."""
        digits = "".join(c for c in self.value.split("_")[0] if c.isdigit())
        return 1 if self.value.startswith("fp8") else int(digits) // 8


class ReduceOp(enum.Enum):
    """`NOP` is for collectives that do not reduce (all-gather, broadcast)."""

    NOP = "nop"
    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


class PacketType(enum.Enum):
    """Packet size of an execution plan whose protocol is `LL` (MSCCL++'s `PacketType`)."""

    LL8 = "LL8"
    LL16 = "LL16"


class CommResult(enum.IntEnum):
    """MSCCL++'s `CommResult`: what `Algorithm.execute` returns (0 is success; see
    `mscclpp.algorithm` for which outcome is a code and which raises)."""

    COMM_SUCCESS = 0
    COMM_UNHANDLED_CUDA_ERROR = 1
    COMM_SYSTEM_ERROR = 2
    COMM_INTERNAL_ERROR = 3
    COMM_INVALID_ARGUMENT = 4
    COMM_INVALID_USAGE = 5
    COMM_REMOTE_ERROR = 6
    COMM_IN_PROGRESS = 7
    COMM_NUM_RESULTS = 8
