"""recurrences.checks: config errors are a dedicated type (still TypeError), API misuse is not; the
non-finite check and its process-wide switch."""
import dataclasses

import pytest
import torch

from recurrences.checks import (ConfigError, ConfigTypeError, check_finite_args, check_int, check_tensor, finite_checks,
                               from_dict, options_of)


@dataclasses.dataclass(frozen=True)
class Options:
    chunk_size: int = 16


@pytest.mark.parametrize("call, match", [
    (lambda: options_of(Options, None, {"chunk_sise": 8}, "toy options"),
     "toy options: unknown key 'chunk_sise' \\(did you mean 'chunk_size'\\?\\)"),
    (lambda: from_dict(Options, {"chunk_size": "8"}, "toy table"), "toy table: chunk_size must be int, got str"),
    (lambda: check_int("steps", 2.5), "steps must be an int, got float 2.5"),
], ids=["unknown-option", "wrong-type", "not-int"])
def test_config_type_errors_are_type_errors_and_config_errors(call, match):
    with pytest.raises(ConfigTypeError, match=match) as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)


def test_a_wrong_tensor_is_a_plain_type_error():
    """Passing a non-tensor to an op is a programming error, not a config error."""
    with pytest.raises(TypeError) as info:
        check_tensor("q", [1.0])
    assert not isinstance(info.value, ConfigError)
    check_tensor("q", torch.zeros(1))


def test_finite_checks_sets_the_default_and_restores_it_on_exit_even_after_an_error():
    bad = torch.tensor([0.0, -float("inf")])
    check_finite_args(None, x=bad)  # off by default
    with pytest.raises(RuntimeError, match="inside"), finite_checks():
        with finite_checks(False):
            check_finite_args(None, x=bad)  # an inner block turns it off
        with pytest.raises(ValueError, match=r"^x must be finite, .* the first at index \[1\]$"):
            check_finite_args(None, x=bad)
        check_finite_args(False, x=bad)  # a call's False wins
        raise RuntimeError("inside")
    check_finite_args(None, x=bad)
    check_finite_args(True, x=None, y=torch.zeros(2))  # None tensors are skipped


@pytest.mark.parametrize("call, match", [
    (lambda: finite_checks(1).__enter__(), "enabled must be a bool, got int 1"),
    (lambda: check_finite_args(1, x=torch.zeros(1)), "check_finite must be a bool or None, got int 1"),
], ids=["finite_checks", "check_finite_args"])
def test_the_switches_take_bools(call, match):
    with pytest.raises(TypeError, match=match):
        call()
