"""bench/baselines.py: the quality bench's baseline rows from its run records, and the corpus they name."""

from __future__ import annotations

from bench import baselines
from btnode.data.identity import manifest_id
from btnode.data.manifest import read_manifest, write_dataset


def run(ces: list[float], per_step: float, steps: list[int], chain: bool = False) -> dict:
    def ev(ce: float) -> dict:
        return {"per_k": {"1": {"sce8": ce}}, "best_block": {"ce": ce + 0.5}} if chain else {"ce": ce}
    return {"per_step_s": per_step, "points": [{"steps": s, "eval": ev(c)} for s, c in zip(steps, ces)]}


def test_every_model_has_a_row_at_every_budget_with_its_own_number():
    got = baselines.rows(corpus="wikitext-2", seed=1, budget=8.0, fractions=(2, 1), seeds=8,
                         chain=run([3.0, 2.0], 0.5, [8, 16], chain=True), ar_block=run([2.5, 1.9], 0.25, [16, 32]),
                         ar_total=run([2.8, 2.1], 1.0, [4, 8]), diloco=run([2.6, 1.95], 0.25, [12, 28]),
                         ensemble=[2.4, 1.8])
    table = {(r["model"], r["budget_s"]): r for r in got}
    assert sorted({m for m, _ in table}) == sorted(baselines.MODELS) and len(got) == 2 * len(baselines.MODELS)
    assert {r["seed"] for r in got} == {1} and {r["corpus"] for r in got} == {"wikitext-2"}
    assert table["chain", 4.0]["ce"] == 3.0 and table["block_alone_best", 8.0]["ce"] == 2.5
    assert table["ar_block", 8.0]["ce"] == 1.9 and table["ar_total", 4.0]["ce"] == 2.8
    assert table["diloco_block", 8.0] == {"corpus": "wikitext-2", "model": "diloco_block", "budget_s": 8.0,
                                          "seed": 1, "ce": 1.95, "steps": 28, "trained_s": 7.0}
    assert table["ensemble_ar_block", 4.0]["ce"] == 2.4
    text = "\n".join(baselines.render(got, None))
    assert "| 4 s | 8 s |" in text and "1.8000" in text


def test_a_prepared_corpus_is_named_by_its_source_and_its_manifest(tmp_path):
    write_dataset(tmp_path, {"train": [b"a" * 100], "test": [b"b" * 10]})
    m = read_manifest(tmp_path)
    assert baselines.describe(str(tmp_path)) == {"name": tmp_path.name, "bytes": 110, "documents": 2,
                                                 "sha256": manifest_id(m).removeprefix("sha256:"),
                                                 "splits": {"train": 100, "tune": 0, "test": 10}}
    assert baselines.describe(baselines.BUNDLED) == {"name": "wikitext-2"}
