"""The decoding loops and what they share: vanilla decoding (vanilla.py), the speculative loop
(speculative.py), draft trees (tree.py) and their attention masks (tree_mask.py), lossless
verification (verify.py) and sampling (sampling.py)."""
