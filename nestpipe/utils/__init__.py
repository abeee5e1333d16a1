"""Small helpers every component uses (the ground floor: no imports from the rest of the package)."""
