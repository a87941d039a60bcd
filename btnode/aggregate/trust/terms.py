"""`TrainingRecords`: the training terms each worker joined with (btnode.train.terms), kept durably in
the state folder: what a replay audit of its updates trains with, and what its claims are judged by."""

from __future__ import annotations

import threading
from pathlib import Path

from btnode.errors import CheckpointError, MalformedInput
from btnode.durable import Journal
from btnode.train.terms import TrainingTerms

TRAINING_FILE = "training.jsonl"  # worker id → the training terms it joined with (a durable.Journal)
LEGACY_TRAINING_FILE = "training.json"  # the same map, rewritten whole on each join by earlier versions


class TrainingRecords:
    """Worker id → the terms of its last admitted join; a restart keeps them."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / TRAINING_FILE
        self._forms: dict[TrainingTerms, tuple[TrainingTerms, str]] = {}
        self._lock = threading.Lock()
        try:
            self.journal = Journal(self.path, legacy=state_dir / LEGACY_TRAINING_FILE)
            self._terms: dict[str, TrainingTerms] = {}
            for worker, text in self.journal.values.items():
                self._terms[worker], self.journal.values[worker] = self._canonical(TrainingTerms.from_json(text))  # type: ignore[arg-type]
        except (OSError, ValueError, TypeError, AttributeError, MalformedInput) as exc:
            raise CheckpointError(f"{self.path} cannot be read as the workers' training settings: {exc}") from exc

    def get(self, worker_id: str) -> TrainingTerms | None:
        return self._terms.get(worker_id)

    def record(self, worker_id: str, terms: TrainingTerms) -> None:
        """One line appended per changed worker: O(1) bytes a join, not O(N)."""
        with self._lock:
            if self._terms.get(worker_id) != terms:
                terms, text = self._canonical(terms)
                self._terms[worker_id] = terms
                self.journal.put(worker_id, text)

    def _canonical(self, terms: TrainingTerms) -> tuple[TrainingTerms, str]:
        """One object and one JSON text for each distinct set of terms, whoever states it: the
        workers of a swarm mostly state the same terms, and a copy per worker cost the root memory
        for as long as the worker is known (bench/join_memory.py measures it)."""
        form = self._forms.get(terms)
        if form is None:
            form = self._forms[terms] = (terms, terms.to_json())
        return form
