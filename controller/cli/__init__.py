"""The ``slotctl`` command line: argument parsing, commands and output formatting."""
