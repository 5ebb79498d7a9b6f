"""The one mapping from vLLM's exceptions to Conveyor's (workers/engines/vllm_engine.py):
every vLLM error class lands in the tree, and a bare ValueError (a bug) is no client error."""

from __future__ import annotations

import inspect

import pytest
import vllm.exceptions
import vllm.v1.engine.exceptions
from vllm.exceptions import VLLMClientError, VLLMError
from vllm.v1.engine.exceptions import EngineDeadError

from shared.errors import ConveyorError, EngineDead, EngineError, InvalidRequest
from workers.engines.vllm_engine import vllm_errors

VLLM_ERRORS = [
    cls
    for module in (vllm.exceptions, vllm.v1.engine.exceptions)
    for _, cls in inspect.getmembers(module, inspect.isclass)
    if issubclass(cls, VLLMError) and cls.__module__ == module.__name__
]


def instance(cls: type[VLLMError]) -> VLLMError:
    """An instance, whatever the constructor wants (a string for each required argument)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except ValueError:  # no __init__ of its own: Exception's
        return cls("bad request")
    required = [
        p for p in parameters
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return cls(*(f"bad {p.name}" for p in required))


@pytest.mark.parametrize("cls", VLLM_ERRORS, ids=lambda cls: cls.__name__)
def test_every_vllm_error_becomes_a_conveyor_error(cls: type[VLLMError]) -> None:
    raised = instance(cls)
    with pytest.raises(ConveyorError) as caught, vllm_errors("generation", param="p"):
        raise raised
    assert caught.value.__cause__ is raised
    if issubclass(cls, EngineDeadError):
        assert isinstance(caught.value, EngineDead)
    elif issubclass(cls, VLLMClientError):
        assert type(caught.value) is InvalidRequest
        assert (caught.value.status, caught.value.param) == (400, "p")
    else:
        assert type(caught.value) is EngineError
        assert caught.value.status == 500


def test_a_bare_value_error_is_not_the_clients_fault() -> None:
    with pytest.raises(ValueError, match="bug") as caught, vllm_errors("generation"):
        raise ValueError("bug in an adapter")
    assert not isinstance(caught.value, ConveyorError)
