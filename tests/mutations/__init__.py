"""The mutation gate: named mutations of the exactly-once rules, each with its witnesses.

``make mutations`` (``python -m tests.mutations``) copies the tree to a scratch
directory per mutant, applies one exact source edit there (never to the working
tree), runs the tests that must catch it, and fails if any mutant survives. See
``docs/internals/testing.md``.
"""
