"""The serving defaults (serve/defaults.py): the measured best of bench/results/serving, a
checkpoint's serving.json over them, and what /v1/models says the settings mean."""

import json
from pathlib import Path

import pytest

from btnode.errors import ConfigError
from btnode.model.config import ModelConfig
from btnode.model.readout import Readout
from btnode.serve.defaults import (MEASURED_K, MEASURED_LABEL, MEASURED_READOUT, SERVING_FILE, describe_settings,
                                   serving_defaults)
from btnode.serve.request import GenerationRequest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "serving" / "default.json"
SERVED = ModelConfig(d_model=128, n_heads=4, n_layers=2, n_blocks=3, context=128, segments=(1, 4, 16, 64))


def test_the_default_is_the_serving_benchs_best_at_ar_quality():
    """The newest serving run: the fastest mode whose every byte is the pooled blocks' among those
    within 0.10 nats/byte of the AR chain is the default, and the old default (pool at the largest
    K) is far from readable there."""
    run = json.loads(RESULTS.read_text())[-1]["detail"]
    assert run["summary"]["best_spec_at_ar_quality"] == MEASURED_LABEL
    wan = {r["label"]: r for r in run["frontier"] if r.get("link") == "wan"}
    best = wan[MEASURED_LABEL]
    assert (best["readout"], best["k"]) == (MEASURED_READOUT.value, MEASURED_K)
    assert best["judge_ce"] <= run["summary"]["judge_ce_ar"] + 0.10
    assert wan["blockwise K=16 N_s=7"]["judge_ce"] > best["judge_ce"] + 3  # pool at K = 16: letter soup
    d = serving_defaults(SERVED)
    assert (d.readout, d.k, d.n_steps, d.source) == (Readout.SPEC, 16, None, "measured")
    assert serving_defaults(ModelConfig(d_model=32, n_heads=2, n_layers=2, n_blocks=3, context=32,
                                        segments=(1, 4))).k == 4  # at most N/8: a prompt keeps 7/8 of the window


def test_a_checkpoints_serving_json_is_its_default(tmp_path):
    (tmp_path / SERVING_FILE).write_text(json.dumps({"readout": "commit", "k": 64, "steps": 13}))
    d = serving_defaults(SERVED, tmp_path)
    assert (d.readout, d.k, d.n_steps) == (Readout.COMMIT, 64, 13) and d.source.endswith(SERVING_FILE)
    r = GenerationRequest(b"The", 8).checked(SERVED, 3, d)
    assert (r.readout, r.k, r.n_steps) == (Readout.COMMIT, 64, 13)
    r = GenerationRequest(b"The", 8, readout="pool").checked(SERVED, 3, d)  # steps are the file's readout's
    assert (r.readout, r.k, r.n_steps) == (Readout.POOL, 64, 7)
    assert serving_defaults(SERVED).source == "measured"  # no folder: the measured default
    for bad, match in (({"readout": "pool", "k": 8}, "k=8 cannot be served"), ({"readout": "avg"}, "unknown readout"),
                       ({"k": 65}, "cannot be served"), ({"steps": 1}, "steps must be"), ({"top_p": 1}, "expected")):
        (tmp_path / SERVING_FILE).write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=match):
            serving_defaults(SERVED, tmp_path)
    (tmp_path / SERVING_FILE).write_text("{")
    with pytest.raises(ConfigError, match="not readable JSON"):
        serving_defaults(SERVED, tmp_path)


def test_the_settings_say_what_they_mean_and_the_prompt_budget_per_k():
    s = describe_settings(SERVED, serving_defaults(SERVED))
    assert s["defaults"] == {"readout": "spec", "k": 16, "steps": None, "source": "measured"}
    assert set(s["readouts"]) == {r.value for r in Readout} and "readable" in s["readouts"]["spec"]
    assert s["prompt_bytes"] == {"1": 128, "4": 125, "16": 113, "64": 65}
    for k, budget in s["prompt_bytes"].items():  # the budget is what a request may send
        GenerationRequest(b"x" * budget, 4, k=int(k), readout="pool").checked(SERVED, 3)
