"""Structured outputs: a request's output constrained to a JSON schema, regex, choice or grammar.

SamplingParams.structured_outputs (pure data, pickles to any process)
  -> Engine.validate: compiler.py compiles it (cached by spec) or refuses the request
  -> the runner (runner/grammar_mask.py): one matcher per sequence; before each sample, the
     matchers catch up on the tokens sampled so far, fill one token bitmask for all structured
     rows, and the sampler masks those rows' logits (kernels/token_bitmask.py)
"""
