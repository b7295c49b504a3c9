"""nas package (filled by later issues)."""
