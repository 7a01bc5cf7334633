"""The Triton kernels in Triton's CPU interpreter (run with TRITON_INTERPRET=1; see conftest.py)."""

# tolerances of the issue: relative error of a kernel against its fp32 reference
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}
