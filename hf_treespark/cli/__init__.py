"""The `treespark` command: one function per subcommand and their table (`commands`), each subcommand's options
(`args`, no torch), calibrate's checks and reports (`calibrate`). `python -m hf_treespark.cli` runs it.

Imports: anything in the package; nothing imports it.
"""
