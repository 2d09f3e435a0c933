"""Black-box rulings: the noise band that separates numerical flips from structural bugs when an
engine gives tokens but no logits (rulings.py), recordings compared token by token (diff.py), and
repro bundles re-checked against the reference (bundles.py)."""
