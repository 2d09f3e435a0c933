"""Speculative sampling: the logits processing (temperature, top-k, top-p), the standard rejection
sampler (`rules`), and two small sampled engines (`engine`): speculative, and the target alone."""
