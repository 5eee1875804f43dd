"""Comparison helpers: relative error with per-dtype tolerances."""
import torch

# forward / gradient tolerances on the relative error, by dtype
FWD_TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 5e-3}
GRAD_TOL = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-2) -> float:
    """||a - b|| / max(||b||, floor), in float64. The floor keeps analytically-zero
    references (e.g. dq of a one-token softmax) from turning rounding noise into a huge
    ratio: below it the tolerance acts as an absolute bound of tol * floor. Test tensors
    are unit-scale with many entries, so their norms sit far above the floor."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def assert_close(a, b, tol, what="", floor: float = 1e-2):
    err = rel_err(a, b, floor)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
