"""How the same model math runs fastest on the machine at hand: few-row CPU linear layers chosen by
measurement (small_rows.py)."""
