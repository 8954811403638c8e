"""Logprobs as JSON numbers: always finite.

A token a constraint forbids (a grammar, allowed_token_ids) has log-probability -inf, and JSON
has no such number (Python writes `-Infinity`, which strict parsers refuse; Starlette refuses to
encode it). Like vLLM, the server writes -9999.0 for it.
"""

LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    """`value`, or LOGPROB_FLOOR for -inf and NaN."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR
