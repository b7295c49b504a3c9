"""hwprofile package (filled by later issues)."""
