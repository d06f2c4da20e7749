"""torch's files without torch: the pickle (read through an allow-list, written back byte for
byte), the zip container, tensors as references to their bytes, float casts in numpy."""
