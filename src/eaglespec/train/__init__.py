"""Training of EAGLE draft heads."""
