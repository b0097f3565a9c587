"""The `rawinfer` command line: main.py builds the parser; one module per command group."""
