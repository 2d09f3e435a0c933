"""Auditing sampled decoding: the exact distribution of one speculative step (`exact`), and tests of
sampled outputs against the target's own distribution by teacher forcing (`teacher`, `stats`, `audit`)."""
