"""Targets: the TargetModel interface over Hugging Face models (target.py), the per-family adapters
(families.py), presets and their loader (presets.py, loader.py), the embedded real default targets
(embedded.py), tiny random targets for tests (tiny.py, tiny_tokenizer.py) and hidden-state capture
(capture.py)."""
