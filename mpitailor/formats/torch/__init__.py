"""torch's files without torch: the pickle (read through an allow-list, written back byte for
byte), the zip container, tensors as references to their bytes, float casts in numpy.

The face (lazyface.py): what the rest of the package imports from here, by name."""
from __future__ import annotations

from mpitailor.formats.lazyface import face

EXPORTS = {
    "cast": "casts",
    "materialize": "rawio", "rawio": "rawio", "read_slice": "rawio",
    "Unpickler": "pickle_read",
    "Size": "rebuild",
    "carried_globals": "safeload", "load": "safeload", "require_regular": "safeload",
    "trust": "safeload",
    "same_values": "state_equal",
    "Tensor": "tensorref", "contiguous_stride": "tensorref", "numpy_dtype": "tensorref",
    "record_crcs": "verify", "verify_records": "verify",
    "write_torch_file": "zip_write", "zip_write": "zip_write",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = face(__name__, EXPORTS)
