"""Worker roles: the stages a job passes through, one job stream per (model, role).

A role's value is what travels on the wire: the last part of a job stream's name
(``conveyor:jobs:{model}:{role}``), the ``role`` of a worker's registry entry, a
job's ``after_encode``. :class:`Role` is a ``StrEnum``, so those bytes are the
same as when roles were plain strings and mixed versions interoperate.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    AGGREGATED = "aggregated"
    """Prefill + decode in one engine."""
    PREFILL = "prefill"
    """Builds the prompt's KV cache and hands the job on to decode."""
    DECODE = "decode"
    """Generates tokens from a handed-over KV cache (or computes the prompt itself)."""
    EMBED = "embed"
    """A pooling model: one embedding per input."""
    ENCODE = "encode"
    """Runs a vision-language model's image encoder; hands embeddings to the language stage."""


ANSWERING_ROLES = (Role.AGGREGATED, Role.DECODE)
"""The roles whose workers produce a generation request's tokens (and so can finish it)."""
