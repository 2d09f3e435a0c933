"""Model loading: the built-in tiny pairs (zoo.py), the bench pair (bench_pair.py), what a loaded pair
is (pair.py), checks of a user's model folder (model_files.py) and the float64 switches (float64.py).
Cache layouts (which layers slide, which keep state) are the algorithms' concern (`engines/ops/layout.py`):
the algorithms one folder up never import this package."""
