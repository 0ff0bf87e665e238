"""The benchmark: which prompts (`suites`), what it compares (`methods`), the run (`run`, also
`python -m hf_treespark.bench`), batches (`batch`), the round profile (`profile`), tables and plots (`report`).

Imports: everything below `training`.
"""
