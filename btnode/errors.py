"""Domain exceptions: the only errors btnode raises on purpose.

Every layer raises these; the CLI turns them into a one-line message and a non-zero exit code,
and (later) the RPC layer maps them to gRPC status codes. Peer or user input is checked with
real checks that raise these, never with `assert`.
"""


class BtnodeError(Exception):
    """Base class. `exit_code` is what the CLI exits with."""

    exit_code = 1


class ConfigError(BtnodeError):
    """A setting is invalid, or two settings contradict each other."""

    exit_code = 2


class DataError(BtnodeError):
    """A corpus file is missing, unreadable, empty, too short or fails its checksum."""

    exit_code = 3


class CheckpointError(BtnodeError):
    """A checkpoint is missing, truncated, corrupted, or has the wrong tensors."""

    exit_code = 4


class ConfigMismatchError(CheckpointError):
    """A checkpoint or peer was made with different swarm-wide settings.

    `fields` names each differing setting as (name, ours, theirs).
    """

    def __init__(self, message: str, fields: list[tuple[str, object, object]]):
        super().__init__(message)
        self.fields = fields


class InputError(BtnodeError):
    """A request cannot be served as asked (prompt too long, untrained segment length...)."""

    exit_code = 5


class DeviceError(BtnodeError):
    """The requested torch device does not exist on this host."""

    exit_code = 6


class InsufficientMemory(BtnodeError):
    """The job would need more memory than this host allows it (its cgroup's limit, MemAvailable or
    --memory-limit): refused before it starts, rather than killed by the kernel mid-run. Retrying
    cannot help until the limit or the job changes (a systemd unit should not restart on it)."""

    exit_code = 9


class PeerInputError(BtnodeError):
    """A peer sent something we refuse. `reason` is a short label for counters ("checksum", ...).

    The RPC layer maps each subclass to a status code; nothing from a refused message is applied.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class MalformedInput(PeerInputError):
    """Truncated stream, unknown tensor, wrong shape or dtype, checksum mismatch, NaN/Inf... (INVALID_ARGUMENT)."""


class TooLarge(PeerInputError):
    """A frame, chunk or update over its size limit (RESOURCE_EXHAUSTED)."""


class UnknownBlock(PeerInputError):
    """A block this node does not own, or a version it does not keep (NOT_FOUND)."""


class StaleUpdate(PeerInputError):
    """An update whose base version is older than the staleness bound allows (FAILED_PRECONDITION)."""


class Forbidden(PeerInputError):
    """The peer's identity may not do this (PERMISSION_DENIED): revoked, a role without the right,
    or a worker id that is not its certificate's name. Not worth retrying."""

    exit_code = 8


class Refused(PeerInputError):
    """A call the peer's identity may make, but not now (FAILED_PRECONDITION): a push to a block it
    did not join, or a second update in one round."""


class PeerUnavailable(BtnodeError):
    """The peer could not be reached, or went away mid-call (UNAVAILABLE). Safe to retry."""

    exit_code = 7


class Overloaded(PeerUnavailable):
    """The peer refused the call for now, over one of its concurrency limits (RESOURCE_EXHAUSTED with
    a limit's reason, or gRPC's own cap). Safe to retry after a backoff; `reason` names the limit."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class JoinPending(Overloaded):
    """A call of a worker whose join here is still on its way (a relay passes a join to its parent
    first and has the worker's data key only once the answer is back): refused for now (ABORTED,
    reason `join_pending`), never final. Retried after a backoff, as any Overloaded."""

    def __init__(self, message: str):
        super().__init__("join_pending", message)


class StageTimeout(PeerUnavailable):
    """A stage did not answer within its timeout (DEADLINE_EXCEEDED; relayed up a chain as
    UNAVAILABLE with this reason). A PeerUnavailable: a spare is tried as for any other."""


class Unauthenticated(BtnodeError):
    """The peer refused us (UNAUTHENTICATED): missing or wrong swarm token. Not worth retrying."""

    exit_code = 8


class CacheMiss(PeerInputError):
    """A serving stage lacks the per-request cache a state builds on; resend from position 0
    (FAILED_PRECONDITION). Happens after a re-route to a spare, or an eviction."""

    def __init__(self, message: str):
        super().__init__("cache_miss", message)
