"""The status table's round trip for the refusals a client must tell apart: a push whose join is under
way (JoinPending, retried) and one from a worker that never joined (Refused `not_joined`, an answer)."""

from __future__ import annotations

import grpc

from btnode.errors import JoinPending, Overloaded, PeerInputError, Refused
from btnode.rpc.client import Retry, SwarmClient
from btnode.rpc.status import REASON_KEY, code_for, error_from_rpc, reason_for


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, reason: str):
        self._code, self._reason = code, reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"

    def trailing_metadata(self) -> tuple:
        return ((REASON_KEY, self._reason),)


def test_join_pending_travels_as_aborted_and_comes_back_retryable():
    exc = JoinPending("w's join is under way")
    assert (code_for(exc), reason_for(exc)) == (grpc.StatusCode.ABORTED, "join_pending")
    back = error_from_rpc(Failed(code_for(exc), reason_for(exc)), "push")
    assert isinstance(back, JoinPending) and isinstance(back, Overloaded) and not isinstance(back, PeerInputError)
    final = error_from_rpc(Failed(grpc.StatusCode.FAILED_PRECONDITION, "not_joined"), "push")
    assert isinstance(final, Refused) and final.reason == "not_joined"


def test_the_client_retries_a_join_pending_call_until_it_lands():
    client = SwarmClient("127.0.0.1:9", retry=Retry(budget_s=5.0, base_s=0.001, cap_s=0.001))
    answers = iter([JoinPending("under way"), JoinPending("under way"), "accepted"])

    def attempt() -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert client._retrying("push", attempt) == "accepted"
    assert client.retries[("push", "join_pending")] == 2
    client.close()
