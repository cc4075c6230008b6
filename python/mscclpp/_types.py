"""Element types and reduction operations, spelled as MSCCL++'s Python API spells them.

Each member's value is the runtime's own name for it, which is what crosses into the native layer.
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
