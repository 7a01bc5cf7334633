"""The Ray executor's tests (``make test-ray``): a local 2-worker Ray cluster on the tiny Llama."""
