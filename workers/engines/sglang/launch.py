"""What ``sglang.Engine`` is launched with: :class:`Settings` -> ``ServerArgs`` fields.

``sglang.Engine(**kwargs)`` takes ``ServerArgs`` fields as keyword arguments
(``python/sglang/srt/server_args.py``); :func:`fit_server_args` adapts them to the
installed release's field names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from typing import Any, Final, Literal

from shared.roles import Role
from shared.settings import WorkerSettings
from workers.engines.host_address import AUTO
from workers.engines.sglang.bootstrap import DEFAULT_BOOTSTRAP_PORT

log = logging.getLogger(__name__)

DisaggregationMode = Literal["null", "prefill", "decode"]
"""SGLang's ``ServerArgs.disaggregation_mode`` values ("null" = aggregated)."""

BIND_HOST: Final = "0.0.0.0"
"""``ServerArgs.host``: the bootstrap server binds here (SGLang's default is 127.0.0.1,
which other machines cannot reach)."""


def disaggregation_mode(role: Role) -> DisaggregationMode:
    """A worker role as SGLang's disaggregation mode: prefill, decode, else aggregated."""
    if role is Role.PREFILL:
        return "prefill"
    if role is Role.DECODE:
        return "decode"
    return "null"


@dataclasses.dataclass(frozen=True, slots=True)
class SglangLaunchConfig:
    """Everything the SGLang engine is launched with (the ``sglang_*`` settings and the
    engine settings every engine reads)."""

    role: Role = Role.AGGREGATED
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    """``--disaggregation-bootstrap-port`` of a prefill engine (SGLang's default)."""
    bootstrap_host: str = AUTO
    """Address decode engines reach this prefill engine's bootstrap server at
    (``auto``: :func:`workers.engines.host_address.advertised_host`)."""
    bind_host: str = BIND_HOST
    transfer_backend: str = "mooncake"
    """``--disaggregation-transfer-backend``: mooncake (SGLang's default) or nixl."""
    ib_device: str | None = None
    tp_size: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    dtype: str = "auto"
    max_running_requests: int | None = None
    disable_any_whitespace: bool = True
    log_level: str = "error"

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> SglangLaunchConfig:
        return cls(
            role=settings.role,
            bootstrap_port=settings.sglang_bootstrap_port,
            bootstrap_host=settings.sglang_bootstrap_host,
            transfer_backend=settings.sglang_transfer_backend,
            ib_device=settings.sglang_ib_device,
            tp_size=settings.sglang_tp_size,
            mem_fraction_static=settings.sglang_mem_fraction_static,
            context_length=settings.max_model_len,
            dtype=settings.dtype,
            max_running_requests=settings.worker_max_slots,
            disable_any_whitespace=not settings.json_any_whitespace,
        )

    @property
    def disaggregation_mode(self) -> DisaggregationMode:
        return disaggregation_mode(self.role)

    def engine_kwargs(self, model_path: str, served_name: str) -> dict[str, Any]:
        """Keyword arguments for ``sglang.Engine`` (= ``ServerArgs`` fields)."""
        kwargs: dict[str, Any] = {
            "model_path": model_path,
            "served_model_name": served_name,
            "dtype": self.dtype,
            "tp_size": self.tp_size,
            "host": self.bind_host,
            "log_level": self.log_level,
            "disaggregation_mode": self.disaggregation_mode,
            # Disjoint output chunks, as Dynamo sets (the decoder copes either way).
            "incremental_streaming_output": True,
            "constrained_json_disable_any_whitespace": self.disable_any_whitespace,
        }
        optional = {
            "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "mem_fraction_static": self.mem_fraction_static,
        }
        kwargs.update({key: value for key, value in optional.items() if value is not None})
        if self.disaggregation_mode != "null":
            kwargs["disaggregation_bootstrap_port"] = self.bootstrap_port
            kwargs["disaggregation_transfer_backend"] = self.transfer_backend
            if self.ib_device:
                kwargs["disaggregation_ib_device"] = self.ib_device
        return kwargs


def fit_server_args(kwargs: dict[str, Any], fields: Collection[str]) -> dict[str, Any]:
    """Fit ``kwargs`` to the installed SGLang's ``ServerArgs`` field names.

    ``incremental_streaming_output`` was called ``stream_output`` in older releases;
    ``constrained_json_disable_any_whitespace`` is dropped where it does not exist.
    Anything else unknown is left in, so ``ServerArgs`` reports it.
    """
    fitted = dict(kwargs)
    if "incremental_streaming_output" not in fields and "stream_output" in fields:
        fitted["stream_output"] = fitted.pop("incremental_streaming_output")
    for optional in ("incremental_streaming_output", "constrained_json_disable_any_whitespace"):
        if optional in fitted and optional not in fields:
            log.warning("this SGLang has no ServerArgs.%s; not setting it", optional)
            del fitted[optional]
    return fitted
