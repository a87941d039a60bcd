"""Fuzzing in CI (a few hundred cases; bench/fuzz.py runs tens of thousands): frame decoding and
every RPC handler of a live aggregator and stage, with random and mutated messages. Hypothesis
draws the case seeds; each seed rebuilds its input (lab/fuzz.py), so a failure names
the one number that reproduces it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from btnode.codec.codecs import Codec
from btnode.rpc.client import SwarmClient
from lab.fuzz import fuzz_frames, fuzz_rpc, start_target

SEEDS = st.integers(min_value=0, max_value=2**63)


@given(SEEDS, st.sampled_from([None, Codec.SPARSE8, Codec.SPARSE2]))
@settings(max_examples=300, deadline=None, derandomize=True)
def test_frame_decoding_accepts_only_whole_valid_blocks(seed, codec):
    """Frames of any codec (None: drawn per case), and of each sparse codec, whose bit-level layouts
    have the most to check."""
    outcome = fuzz_frames(seed, codec)
    assert outcome == "ok" or outcome.startswith("refused: "), outcome


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    t = start_target(tmp_path_factory.mktemp("fuzz"))
    yield t
    t.shutdown()


@given(SEEDS)
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_rpc_handlers_refuse_with_a_status_and_never_crash(target, seed):
    fuzz_rpc(target, seed)


def test_state_uploads_for_audits_are_taken_or_refused_with_a_status(target):
    codes = Counter(fuzz_rpc(target, seed, only="SubmitState") for seed in range(150))
    assert codes["OK"] and codes["INVALID_ARGUMENT"], codes  # whole claimed states taken, the rest refused
    assert target.audit_agg.counters[("state_refused", "no_audit")], target.audit_agg.counters


def test_relay_evidence_is_taken_or_refused_with_a_status(target):
    codes = Counter(fuzz_rpc(target, seed, only="SubmitEvidence") for seed in range(150))
    assert codes["OK"] and codes["INVALID_ARGUMENT"], codes  # whole evidence taken, the rest refused
    events = target.agg.counters
    assert events[("relay_audits", "passed")] and events[("evidence_refused", "evidence")], events
    assert not target.model_changed()


def test_after_the_fuzzing_the_node_serves_and_no_model_changed(target):
    for seed in range(100):
        fuzz_rpc(target, seed)
    client = SwarmClient(target.address, timeout_s=10)
    assert client.status().fingerprint  # still answering
    client.close()
    assert not target.model_changed()


def test_relays_commits_of_child_updates_are_taken_or_refused_with_a_status(target):
    codes = Counter(fuzz_rpc(target, seed, only="Draw") for seed in range(150))
    assert codes["OK"] and codes["INVALID_ARGUMENT"], codes  # fresh claims committed or drawn, the rest refused
    events = target.audit_agg.counters
    assert events[("draws", "drawn")] and events[("draws_refused", "claim")], events
    assert not target.model_changed()
