"""kvzoo's tests: a package, so that pytest puts the repository root on sys.path, not tests/ (a folder
there named like an installed package -- once tests/triton -- would shadow it for every import)."""
