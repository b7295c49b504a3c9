"""supernet package (filled by later issues)."""
