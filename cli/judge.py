"""`btnode judge`: judge CE and form of generated continuations (a JSONL file of samples), of the real
continuations of the fixed prompts (--reference), and a dump of those prompts (--prompts-out).

Samples are JSON lines {"prompt": ..., "continuation": ...} whose strings hold bytes as latin-1:
one character per byte, U+0000…U+00FF (Python: `data.decode("latin-1")`); other keys are kept
beside each sample's scores in the JSON output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from btnode.node.settings import HostConfig
from btnode.settings import build
from btnode_cli.options import device, takes

DEFAULT_JUDGE = Path("runs/judge")  # where bench/judge.py writes the judge checkpoint


def read_samples(path: Path) -> list[dict]:
    """Parse and check a samples file; every fault names its line."""
    from btnode.errors import InputError

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise InputError(f"samples file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"samples file {path} cannot be read as UTF-8 JSON lines: {exc}") from exc
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path} line {no} is not JSON: {exc}") from exc
        if not isinstance(rec, dict):
            raise InputError(f"{path} line {no} is not a JSON object")
        sample = {k: v for k, v in rec.items() if k not in ("prompt", "continuation")}
        for key in ("prompt", "continuation"):
            value = rec.get(key)
            if not isinstance(value, str) or not value:
                raise InputError(f"{path} line {no}: {key!r} must be a non-empty string (bytes as latin-1)")
            try:
                sample[key] = value.encode("latin-1")
            except UnicodeEncodeError as exc:
                raise InputError(f"{path} line {no}: {key!r} has a character above U+00FF; write bytes as "
                                 "latin-1, one character per byte") from exc
        sample["line"] = no
        out.append(sample)
    if not out:
        raise InputError(f"samples file {path} holds no samples")
    return out


@takes(HostConfig)
def judge(samples: Annotated[Optional[Path], typer.Argument(
              help="JSONL of {\"prompt\", \"continuation\"}, bytes as latin-1 strings.")] = None,
          checkpoint: Annotated[Path, typer.Option(
              "--checkpoint", help="The judge: an autoregressive checkpoint folder (bench/judge.py makes one).")] = DEFAULT_JUDGE,
          reference: Annotated[bool, typer.Option(
              "--reference", help="Also score the real continuations of the fixed prompts.")] = False,
          prompts_out: Annotated[Optional[Path], typer.Option(
              "--prompts-out", help="Write the fixed prompts (and their real continuations) here as JSONL.")] = None,
          stride: Annotated[Optional[int], typer.Option(
              "--stride", help="Sliding-window stride in bytes (default: half the judge's context).")] = None,
          words_file: Annotated[Optional[Path], typer.Option(
              "--words", help="Word list, one word a line (default: Debian's wamerican).")] = None,
          json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the results here.")] = None,
          **flags: Any) -> None:
    """Judge generated text: judge CE (nats/byte of each continuation given its prompt) and form."""
    from btnode.errors import CheckpointError, InputError

    # Input faults first, before torch loads: they answer in a fraction of a second.
    if samples is None and not reference and prompts_out is None:
        raise InputError("nothing to do: give a samples file, --reference or --prompts-out")
    rows = {str(samples): read_samples(samples)} if samples is not None else {}
    scoring = bool(rows) or reference
    if scoring and not checkpoint.is_dir():
        raise CheckpointError(f"judge checkpoint folder {checkpoint} does not exist (bench/judge.py makes one)")
    if words_file is not None and not words_file.is_file():
        raise InputError(f"word list {words_file} does not exist")

    from btnode.evaluation import judge as jd
    from btnode.store.models import kind_of, load_ar

    host = build(HostConfig, flags)
    data = host.load_corpus() if reference or prompts_out else None
    prompts = jd.fixed_prompts(data.test) if data is not None else []
    if data is not None:
        typer.echo(f"fixed prompts from {data.test.description} ({data.source})")
    if prompts_out is not None:
        with open(prompts_out, "w") as f:
            for p in prompts:
                f.write(json.dumps({"index": p.index, "offset": p.offset, "prompt": p.prompt.decode("latin-1"),
                                    "reference": p.reference.decode("latin-1")}) + "\n")
        typer.echo(f"wrote {len(prompts)} fixed prompts ({jd.PROMPT_BYTES} bytes, real continuations of "
                   f"{jd.CONTINUATION_BYTES} bytes) to {prompts_out}")
    if not scoring:
        return
    if reference:
        rows["reference"] = [{"prompt": p.prompt, "continuation": p.reference, "index": p.index} for p in prompts]
    if kind_of(checkpoint) != "ar":
        raise CheckpointError(f"{checkpoint} holds blocks; the judge must be an autoregressive checkpoint")
    loaded = load_ar(checkpoint)
    dev = device(host.device)
    model, cfg = loaded.model.to(dev), loaded.cfg
    words = jd.english_words(words_file) if words_file is not None else jd.english_words()
    result: dict = {"checkpoint": str(checkpoint),
                    "judge": {"n_layers": loaded.meta["n_layers"], "d_model": cfg.d_model, "context": cfg.context,
                              "step": loaded.meta.get("step")},
                    "word_list": words.source, "encoding": "latin-1",
                    **({"data": data.source, "prompts_from": data.test.description} if data is not None else {})}
    typer.echo(f"judge {checkpoint}: {loaded.meta['n_layers']} layers, d_model {cfg.d_model}, context {cfg.context}; "
               f"word list: {words.source}")
    typer.echo(f"{'samples':<28s} {'n':>4s} {'judge CE':>9s} {'distinct4':>9s} {'repeat16':>9s} {'words':>7s}")
    for name, recs in rows.items():
        report = jd.score_samples(model, [(r["prompt"], r["continuation"]) for r in recs], words=words,  # type: ignore[arg-type]
                                  stride=stride, device=dev)
        d = report.to_dict()
        d["samples"] = [{**{k: v for k, v in r.items() if k not in ("prompt", "continuation")}, **s}
                        for r, s in zip(recs, d["samples"])]
        result["stride"] = report.stride
        result["reference" if name == "reference" else "samples"] = {"name": name, **d}
        typer.echo(f"{name[-28:]:<28s} {report.n_samples:>4d} {report.judge_ce:>9.4f} {report.distinct4:>9.4f} "
                   f"{report.repeat_frac:>9.4f} {report.word_rate:>7.4f}")
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=1) + "\n")


def register(app: typer.Typer) -> None:
    app.command("judge")(judge)
