"""recurrences.checks: config errors are a dedicated type (still TypeError), API misuse is not."""
import dataclasses

import pytest
import torch

from recurrences.checks import ConfigError, ConfigTypeError, check_int, check_tensor, from_dict, options_of


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
