"""Pallas TPU kernels. Each module: one kernel family, a plain ``*_reference`` beside it, a cost
estimate on the call (from the frontend-neutral cost models in ``dualop/kernels/cost.py``). They run
compiled on a TPU and in interpret mode elsewhere."""
