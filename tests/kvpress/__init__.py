"""kvpress interop tests: run in .venv-kvpress by `make test-kvpress` (collected only with KVZOO_KVPRESS_TESTS=1)."""
