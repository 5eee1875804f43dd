"""Comparison helpers: relative error with per-dtype tolerances."""
import torch

# forward / gradient tolerances on the relative error, by dtype
FWD_TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 5e-3}
GRAD_TOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, tiny), in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(a, b, tol, what=""):
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
