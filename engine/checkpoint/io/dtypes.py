"""Tensor element types by name, with their sizes, for every format the inspector reads.

Names are torch's (``float32``, ``bfloat16``...). Each reader maps its own spelling onto
them: torch pickles name a dtype (``torch.float32``) or a storage class
(``torch.FloatStorage``), safetensors headers use codes (``F32``, ``BF16``). Nothing here
imports torch: inspecting a checkpoint never needs it.
"""

from __future__ import annotations

# torch dtype name -> bytes per element (sub-byte types round up: a tensor's bytes are
# computed as ceil(elements * bits / 8)).
ITEM_BITS: dict[str, int] = {
    "float64": 64, "float32": 32, "float16": 16, "bfloat16": 16,
    "complex128": 128, "complex64": 64, "complex32": 32,
    "int64": 64, "int32": 32, "int16": 16, "int8": 8,
    "uint64": 64, "uint32": 32, "uint16": 16, "uint8": 8,
    "bool": 8,
    "float8_e4m3fn": 8, "float8_e4m3fnuz": 8, "float8_e5m2": 8, "float8_e5m2fnuz": 8,
    "float8_e8m0fnu": 8, "float4_e2m1fn_x2": 8,
    "qint8": 8, "quint8": 8, "qint32": 32, "quint4x2": 8, "quint2x4": 8,
    "bits8": 8, "bits16": 16, "bits1x8": 8, "bits2x4": 8, "bits4x2": 8,
}

# torch.<Name>Storage (legacy typed storages that torch.save still writes) -> dtype name.
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "QInt8Storage": "qint8", "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}

# safetensors header codes -> dtype name.
SAFETENSORS_DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64", "C128": "complex128", "F4": "float4_e2m1fn_x2",
}


def is_dtype_name(name: str) -> bool:
    """True if ``torch.<name>`` is a dtype the inspector knows."""
    return name in ITEM_BITS


def tensor_nbytes(dtype: str, numel: int) -> int:
    """Bytes that ``numel`` elements of ``dtype`` occupy (0 for an unknown dtype)."""
    bits = ITEM_BITS.get(dtype)
    if bits is None:
        return 0
    return (numel * bits + 7) // 8


def storage_dtype(storage_class_name: str) -> str | None:
    """dtype of a legacy ``torch.<X>Storage`` class name, or None if not one."""
    if storage_class_name in STORAGE_DTYPES:
        return STORAGE_DTYPES[storage_class_name]
    # torch names newer types by capitalising the dtype: Float8_e4m3fnStorage, UInt16Storage.
    if storage_class_name.endswith("Storage"):
        stem = storage_class_name[: -len("Storage")].lower()
        if stem in ITEM_BITS:
            return stem
    return None
