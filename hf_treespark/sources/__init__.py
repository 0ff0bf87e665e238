"""Where a round's branches come from besides the drafter's own pool: prompt lookup (`lookup`: continuations of
the text's suffix found earlier in it) and the datastore (`datastore`: continuations in the target's earlier
outputs, a suffix index).

Imports: `core` only.
"""
