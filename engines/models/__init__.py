"""Model loading: the built-in tiny pairs (zoo.py), the bench pair (bench_pair.py), what a loaded pair
is (pair.py), checks of a user's model folder (model_files.py), cache layouts (layout.py) and the
float64 switches (float64.py). The decoding algorithms one folder up never load models themselves."""
