"""Sums: the exact running sums, the outer step and the spill files a round's arithmetic stands on."""
