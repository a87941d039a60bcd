"""The context window of a request as generation goes on, shared by every chain (blockwise and AR,
plain and speculative) so that cached and uncached paths, and plain and drafted decoding, see
exactly the same windows.

A window grows with the text until it would hold more than `limit` bytes; then it restarts with
the last `keep` bytes. Between restarts every step only appends, so a stage's cache of the window
stays valid and the new bytes are all it has to encode. Sliding the window by one byte per step
(what the chains did before) would re-encode the whole window at every step once it is full.
`keep` = min(limit, N/2): every row still sees at least N/2 bytes of context, as the scored rows
of training and evaluation do.
"""

from __future__ import annotations


def keep_bytes(limit: int, context: int) -> int:
    """Bytes a window restarts with: min(limit, N/2)."""
    return max(1, min(limit, context // 2))


def window_start(start: int, length: int, limit: int, keep: int) -> int:
    """Where the window begins once the text is `length` bytes long, given that it began at `start`.

    Unchanged while text[start:length] fits in `limit` bytes; else text[length − keep:length].
    """
    if not 1 <= keep <= limit:
        raise ValueError(f"need 1 ≤ keep ≤ limit, got keep={keep}, limit={limit}")
    if not 0 <= start <= length:
        raise ValueError(f"window start {start} outside text of {length} bytes")
    return start if length - start <= limit else length - keep
