"""Constrained decoding (JSON schema, regex, choice, GBNF grammar) through xgrammar.

- ``check``: what a request may ask for, checked where it enters the engine (sizes,
  nesting, then a tokenizer-free parse by the grammar engine): bad input is a 400 that
  names the field, before anything reaches the engine core.
- ``compiler``: grammars compile against the model's vocabulary in a thread pool, off
  the engine loop, cached by the constraint's canonical key.
- ``manager``: the sampling rank's per-request matchers; each step it fills the token
  bitmask of the rows that need one (while the forward runs) and follows the tokens.
- ``vocab``: the vocabulary as xgrammar reads it.

The scheduler never sees any of it: a constraint is part of SamplingParams, and the
worker that samples owns the matchers (docs/structured-outputs.md says why).
"""
