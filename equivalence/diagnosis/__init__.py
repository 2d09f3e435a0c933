"""Why a divergence happened: symptom checks (checks.py), replay experiments on the reference
(replay.py) and the ordering that turns them into one class and its evidence (core.py)."""
