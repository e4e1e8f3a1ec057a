"""CMF v2 constants: magic, version, feature bits, dtype ids and limits.

Pure data. Everything imports this module; it imports nothing from the project.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

MAGIC = b"CMF\x01"
VERSION = 2
ENVELOPE_SIZE = 128
DATA_ALIGN = 4096  # data_off must be a multiple of this (spec §1.2)
TENSOR_ALIGN = 64  # every tensor offset relative to data_off (spec §4)
LARGE_TENSOR_BYTES = 16384  # payloads this big are placed on 4096 (REFERENCE_NOTES §1.4)
LARGE_TENSOR_ALIGN = 4096

DIR_PREFIX = 16  # u64 count + u64 pool_off
DIR_RECORD_SIZE = 56
MAX_NDIM = 6

# Defensive limits: refuse absurd values before allocating anything.
MAX_HEADER_BYTES = 256 * 1024 * 1024
MAX_TENSORS = 50_000_000  # a directory record is 56 bytes; this is already 2.8 GB of records
# Header / masks-meta JSON nesting: real headers nest 5-6 levels; code that walks the views
# recursively (serialize, deepcopy, to_dict) must never meet a RecursionError deep inside.
MAX_JSON_DEPTH = 64

# Envelope field offsets (spec §1).
OFF_MAGIC = 0x00
OFF_VERSION = 0x04
OFF_FLAGS = 0x08
OFF_FEATURES = 0x0C
OFF_SECTIONS = 0x10
OFF_HEADER_HASH = 0x70
OFF_DIR_HASH = 0x78

SECTION_NAMES = ("header", "dir", "data", "masks", "vocab", "index")


class Feature(IntFlag):
    """Bits of `required_features` (spec §1.1)."""

    TENSOR_DIR = 1 << 0
    BINARY_MASKS = 1 << 1
    QUANT_2F = 1 << 2
    DELTA_MASKS = 1 << 3  # reserved: refused
    HOT_PACKS = 1 << 4  # reserved: refused
    LOOP_MASKS = 1 << 5
    SKILL_FILE = 1 << 6


SUPPORTED_FEATURES = (
    Feature.TENSOR_DIR | Feature.BINARY_MASKS | Feature.QUANT_2F | Feature.LOOP_MASKS | Feature.SKILL_FILE
)


class Dtype(IntEnum):
    """Tensor dtype ids (spec §3.1; 16 = q2tp per REFERENCE_NOTES §1.7). Ids are never reused."""

    F32 = 0
    F16 = 1
    BF16 = 2
    Q8_ROW = 3
    Q4_BLOCK = 4
    MIX8_4 = 5  # reserved
    U8 = 6  # reserved in the LLM table; raw bytes in pipeline containers (spec §12)
    Q4_COL = 7  # reserved
    VBIT = 8
    Q8_2F = 9
    VBIT_RO = 10
    Q4_TILED = 11
    Q1 = 12
    Q1S = 13
    Q1T = 14
    Q4TP = 15
    Q2TP = 16

    @property
    def label(self) -> str:
        """The lowercase name used in files, the CLI and docs (e.g. ``q4_tiled``)."""
        return self.name.lower()


MAX_DTYPE = max(int(d) for d in Dtype)
RESERVED_DTYPES = frozenset({Dtype.MIX8_4, Dtype.U8, Dtype.Q4_COL})
# Dtypes whose presence raises the QUANT_2F feature bit (REFERENCE_NOTES §1.1: not vbit_ro).
QUANT_2F_DTYPES = frozenset({Dtype.VBIT, Dtype.Q8_2F})
# Dtypes with a payload length that cannot be derived from the shape alone.
VARIABLE_DTYPES = frozenset({Dtype.VBIT, Dtype.VBIT_RO, Dtype.Q1S, Dtype.Q1T})

DTYPE_BY_LABEL = {d.label: d for d in Dtype}

# Allowed `quant_type` strings in the header (REFERENCE_NOTES §1.2).
QUANT_TYPES = ("Q8_ROW", "Q4_BLOCK", "Q8_2F", "VBIT", "BF16", "F16", "F32")
LAYER_TYPES = ("FullAttention", "SlidingAttention", "LinearAttention", "ShortConv", "Kda")
NORM_STYLES = ("qwen", "gemma")
MASK_PRIORITIES = ("Fallback", "Normal", "Primary")

VBIT_WIDTHS = (3, 4, 5, 6, 8)
GROUP = 32  # quantization group size
