"""The package's file I/O below the checkpoint formats: bounded reads, byte ranges, whole
files with their manifest record, CRC-32, the file system a job sees."""
