"""The upstream series' edits, descriptions, tests and docs pages (see tools/upstream_patch.py)."""
