"""The one dtype table: mpitailor's short names for tensor dtypes and what each is called in
torch, in safetensors headers and in HF's `config.json`. Torch-free (the planner uses it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Dtype:
    name: str         # mpitailor's: "bf16"
    itemsize: int     # bytes per element
    safetensors: str  # in a safetensors header: "BF16"
    torch: str        # torch's attribute, and HF config.json's `torch_dtype`: "bfloat16"


DTYPES: dict[str, Dtype] = {d.name: d for d in (
    Dtype("fp32", 4, "F32", "float32"),
    Dtype("bf16", 2, "BF16", "bfloat16"),
    Dtype("fp16", 2, "F16", "float16"),
    Dtype("f64", 8, "F64", "float64"),
    Dtype("i64", 8, "I64", "int64"),
    Dtype("i32", 4, "I32", "int32"),
    Dtype("i16", 2, "I16", "int16"),
    Dtype("i8", 1, "I8", "int8"),
    Dtype("u8", 1, "U8", "uint8"),
    Dtype("bool", 1, "BOOL", "bool"),
)}
FLOATS = ("bf16", "fp16", "fp32")  # what weights and exports may be written in
_ALIASES = {alias: d.name for d in DTYPES.values() for alias in (d.torch, d.name)}
_BY_SAFETENSORS = {d.safetensors: d.name for d in DTYPES.values()}


def canonical(name: str) -> str | None:
    """"bfloat16", "torch.bfloat16" or "bf16" -> "bf16"; None for a name not in the table."""
    return _ALIASES.get(name.removeprefix("torch."))


def from_safetensors(name: str) -> str | None:
    """A safetensors header's dtype ("BF16") -> "bf16"; None for one not in the table."""
    return _BY_SAFETENSORS.get(name)


def name_of(torch_dtype) -> str:
    """A torch dtype -> "bf16"; a dtype not in the table keeps torch's spelling."""
    return canonical(str(torch_dtype)) or str(torch_dtype)
