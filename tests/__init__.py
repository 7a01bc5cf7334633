"""kvzoo's tests: a package, so that pytest puts the repository root on sys.path, not tests/ (where
tests/triton would shadow the real triton package for every import of it)."""
