"""The repo's own tools, not part of the package (the wheel leaves them out): the tiny
DeepSpeed training runs that make the tests' fixtures and the benchmarks' saves (tinytrain/),
and `make demo` (demo.py). They import mpitailor like any user; mpitailor never imports them."""
