"""``ovqflex bench PROFILE.toml``: run a profile's scenarios in one process."""
from .runner import run_profile

__all__ = ["run_profile"]
