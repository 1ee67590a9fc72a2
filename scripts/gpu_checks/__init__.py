"""The rows of scripts/gpu_check.py, one module per row group (issue 34: the 1,300-line
script split into modules of at most 600 lines). scripts/gpu_check.py is the entry point
and answers every name of these modules as its own attribute."""
