"""Serving frontier (issue #11): every serving mode's speed over an emulated WAN and loopback against
the quality of what it serves, judged as text.

Modes: the one-sweep block chain at every trained K ∈ {1, 4, 16, 64} and N_s ∈ --n-steps, with
and without tail steps (when the model has a tail and K > 1); blockwise speculative decoding at every
K (readouts "spec" and "spec-fill": block 0 drafts, the pooled blocks verify, no sweep); the
autoregressive chain plain and
with speculative decoding (a small AR draft at the entry); and the real continuations (the
reference row). The served models are trained as deployed: one worker per block, each with the
AR model's per-worker budget (see BENCHMARKS.md for the run that made them).

    .venv/bin/python -m bench.judge                           # the judge (once)
    .venv/bin/python -m bench.tail --main BLOCKS --judge runs/judge --served runs/served   # blocks + tail
    .venv/bin/python -m bench.serving --blocks runs/served --ar AR6 --draft AR2   # ~25 min on 2 cores

Quality: each mode continues every fixed judge prompt (64 bytes, 256 new bytes, temperature 1;
greedy separately) through the serving code itself, in one process (`serve.driver` over local
stages: the same bytes a remote chain returns, as tests/integration/test_serving*.py check), and
`btnode.evaluation.judge` scores them. Speed: the chains run as `btnode join --role stage` processes,
three hosts in a row (h1…h3; a tail stage shares h3 with block 2, a machine holding two blocks), the
client on h0; each hop of the WAN is 20 ms one way at 100 Mbit/s (namespaces, tbf, delay line).
bytes/s = new bytes / wall time over --speed-prompts requests after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.flags import BenchParser
from bench.report import RESULTS, ROOT, invoked, is_published, module_command, publish, pyplot, shown, table
from bench.runs import Metric
from btnode.node.launch import Popen, start_node, stop_processes

N_BYTES = 256
BLOCK_PORT, AR_PORT = 7100, 7200  # + stage index, inside each host's namespace
DRAFT_LEN = 8


def modes(cfg, n_steps: list[int], ks: list[int], tail_steps: int, k1_steps: list[int] | None = None,
          readouts: tuple[str, ...] = ("pool", "commit", "spec", "spec-fill"),
          spec_ks: tuple[int, ...] = (1, 4, 8, 16, 32)) -> list[dict]:
    out = []
    for k in ks:
        if k not in cfg.segments:
            continue
        for ns in (k1_steps or n_steps) if k == 1 else n_steps:
            if "pool" in readouts:
                out.append({"mode": "blockwise", "k": k, "n_steps": ns, "n_tail": 0, "readout": "pool"})
            if k > 1 and "commit" in readouts:  # the last stage commits the segment byte by byte
                out.append({"mode": "blockwise", "k": k, "n_steps": ns, "n_tail": 0, "readout": "commit"})
            if cfg.tail_blocks and k > 1 and tail_steps and "pool" in readouts:
                out.append({"mode": "blockwise", "k": k, "n_steps": ns, "n_tail": tail_steps, "readout": "last"})
        if k > 1 and "spec-fill" in readouts:  # no sweep: one row per K (N_s is checked, not run)
            out.append({"mode": "blockwise", "k": k, "n_steps": min(n_steps), "n_tail": 0, "readout": "spec-fill"})
    if "spec" in readouts:  # K is a draft length here, trained or not; K = 1 is the pool itself, no draft
        out += [{"mode": "blockwise", "k": k, "n_steps": min(n_steps), "n_tail": 0, "readout": "spec"} for k in spec_ks]
    out.append({"mode": "ar", "k": 1, "n_steps": 0, "n_tail": 0})
    out.append({"mode": "ar_spec", "k": 1, "n_steps": 0, "n_tail": 0, "draft": DRAFT_LEN})
    return out


def label(m: dict) -> str:
    if m["mode"] == "blockwise" and m.get("readout", "").startswith("spec"):
        return f"blockwise K={m['k']} {m['readout']}" + (f" (block {m['alone']} alone)" if "alone" in m else "")
    if m["mode"] == "blockwise":
        return (f"blockwise K={m['k']} N_s={m['n_steps']}" + (f" tail={m['n_tail']}" if m["n_tail"] else "")
                + (" commit" if m.get("readout") == "commit" else "") + (f" (block {m['alone']} alone)" if "alone" in m else ""))
    return "AR speculative G=%d" % m["draft"] if m["mode"] == "ar_spec" else "AR plain"


# --- quality: the serving code in one process --------------------------------------------------------


def continuations(m: dict, prompts: list[bytes], models: dict, temperature: float) -> tuple[list[bytes], dict]:
    """The bytes this mode serves after each prompt (seed i for prompt i), and traversal counts."""
    import torch

    from btnode.serve.ar import local_ar_chain
    from btnode.serve.draft import ARDrafter
    from btnode.serve.driver import generate, generate_ar
    from btnode.serve.request import GenerationRequest
    from btnode.serve.stages import local_chain

    dev = torch.device("cpu")
    texts, traversals, drafted, accepted, pooled = [], 0, 0, 0, 0
    if m["mode"] == "blockwise":
        cfg, blocks = models["blocks"]
        # "alone": one block evaluates every grid point of the same sweep (the composition check); with
        # readout "spec" it drafts and verifies itself, so it is that block's own autoregressive sampling
        chain = local_chain([blocks[m["alone"]]] * cfg.n_blocks if "alone" in m else
                            blocks if m["n_tail"] else blocks[:cfg.n_blocks], dev)
        for i, p in enumerate(prompts):
            parts = list(generate(chain, cfg, cfg.n_blocks, GenerationRequest(
                p, n_bytes=N_BYTES, k=m["k"], n_steps=m["n_steps"], n_tail=m["n_tail"], seed=i, temperature=temperature,
                readout=m.get("readout"))))
            texts.append(b"".join(r.new_bytes for r in parts))
            traversals += len(parts)
            accepted += sum(r.accepted for r in parts)
            # spec: the kept draft bytes and the replacement at a rejection are the pool's; the rest is filled
            pooled += sum(min(len(r.new_bytes), r.accepted + 1) for r in parts)
        if not m.get("readout", "").startswith("spec"):
            return texts, {"traversals": traversals}
        return texts, {"traversals": traversals, "drafted": traversals * m["k"], "accepted": accepted,
                       "acceptance": accepted / (traversals * m["k"]), "pooled_frac": pooled / (N_BYTES * len(prompts)),
                       "bytes_per_traversal": N_BYTES * len(prompts) / traversals}
    ar = models["ar"]
    drafter = ARDrafter(models["draft"], device=dev) if m["mode"] == "ar_spec" else None
    chain = local_ar_chain(ar, 3, dev, drafter=drafter)
    for i, p in enumerate(prompts):
        parts = list(generate_ar(chain, ar.cfg, GenerationRequest(p, n_bytes=N_BYTES, seed=i, temperature=temperature,
                                                                  draft_len=m.get("draft", 0)), draft=drafter))
        texts.append(b"".join(r.new_bytes for r in parts))
        traversals += len(parts)
        drafted += sum(r.drafted for r in parts)
    return texts, {"traversals": traversals, "drafted": drafted}


def quality(args: argparse.Namespace, all_modes: list[dict]) -> tuple[dict, dict]:
    """judge scores per mode label and temperature, the real text's, and generation counts."""
    from btnode.data import corpus
    from btnode.evaluation import judge as J
    from btnode.store.models import load_ar, load_blocks

    data = corpus.bundled()
    judge = load_ar(args.judge).model.eval()
    words = J.english_words()
    prompts = J.fixed_prompts(data.test, args.prompts)
    models = {"blocks": load_blocks(args.blocks), "ar": load_ar(args.ar).model.eval(),
              "draft": load_ar(args.draft).model.eval()}

    def score(pairs: list) -> dict:
        return J.score_samples(judge, pairs, words=words).to_dict(per_sample=False)

    real = score([(p.prompt, p.reference[:N_BYTES]) for p in prompts])
    out: dict = {}
    for m in all_modes:
        for temperature in ((1.0,) if "alone" in m else (1.0, 0.0)):
            if temperature == 0.0 and not args.greedy_prompts:
                continue
            t0 = time.perf_counter()
            use = prompts if temperature else prompts[:args.greedy_prompts]
            texts, counts = continuations(m, [p.prompt for p in use], models, temperature)
            s = score([(p.prompt, t) for p, t in zip(use, texts)])
            s.update(counts, gen_s=time.perf_counter() - t0, sample=texts[0].decode("utf-8", "replace")[:160],
                     traversals_per_byte=counts["traversals"] / (N_BYTES * len(use)), n_prompts=len(use))
            out[(label(m), temperature)] = (s, texts)
            print(f"[serving] {label(m)} T={temperature:g}: judge CE {s['judge_ce']:.3f}, distinct4 "
                  f"{s['distinct4']:.3f}, repeat {s['repeat_frac']:.3f}, words {s['word_rate']:.3f} "
                  f"({s['gen_s']:.0f} s)", flush=True)
    for temperature in (1.0, 0.0) if args.greedy_prompts else (1.0,):  # makes the speculative row's quality the plain row's
        plain, spec = out[("AR plain", temperature)][1], out[(f"AR speculative G={DRAFT_LEN}", temperature)][1]
        if plain != spec:
            raise SystemExit(f"speculative decoding served other bytes than plain decoding at T={temperature}")
    return {k: v[0] for k, v in out.items()}, real


# --- speed: real stage processes over loopback and the emulated WAN ---------------------------------


def client(entries: dict, modes_json: str, n_prompts: int) -> dict:
    """Runs where the requests come from (inside h0 on the emulated WAN)."""
    from btnode.data import corpus
    from btnode.evaluation import judge as J
    from btnode.rpc.stages import generate_remote
    from btnode.serve.request import GenerationRequest

    prompts = [p.prompt for p in J.fixed_prompts(corpus.bundled().test, max(n_prompts, 1))][:n_prompts]
    out = {}
    for m in json.loads(modes_json):
        entry = entries["ar" if m["mode"].startswith("ar") else "block"]
        kw = dict(k=m["k"] if m["mode"] == "blockwise" else None, n_steps=m["n_steps"], n_tail=m["n_tail"],
                  draft_len=m.get("draft", 0), temperature=1.0, readout=m.get("readout") or None)
        list(generate_remote(entry, GenerationRequest(prompts[0], n_bytes=32, seed=99, **kw)))  # warm-up
        wall, traversals, accepted, total = [], 0, 0, 0
        for i, p in enumerate(prompts):
            t0 = time.perf_counter()
            last = None
            for last in generate_remote(entry, GenerationRequest(p, n_bytes=N_BYTES, seed=i, **kw)):
                total += len(last.new_bytes)
            wall.append(time.perf_counter() - t0)
            traversals += last.traversals if last else 0
            accepted += last.accepted if last else 0
        out[label(m)] = {"bytes_per_s": total / sum(wall), "traversals_per_byte": traversals / total,
                         "bytes_per_traversal": total / traversals, "latency_s": statistics.median(wall),
                         "accepted": accepted}
        print(f"[serving] {label(m)}: {out[label(m)]['bytes_per_s']:.1f} bytes/s, "
              f"{out[label(m)]['traversals_per_byte']:.3f} traversals/byte", file=sys.stderr, flush=True)
    return out


def start_chains(args: argparse.Namespace, tail: bool, popen: Callable[[int], Popen], address: Callable[[int], str],
                 workdir: Path) -> list[subprocess.Popen]:
    """Block stages 0..2 (+ the tail stage beside block 2) and AR stages 0..2 (draft at the entry);
    popen(pos) starts a command on position pos's host, address(pos) is that host's address."""
    procs: list[subprocess.Popen] = []
    specs = []
    tail_port = BLOCK_PORT + 3
    for pos in (2, 1, 0):
        nxt_b = (["--next", f"{address(pos)}:{tail_port}"] if tail else []) if pos == 2 else \
            ["--next", f"{address(pos + 1)}:{BLOCK_PORT + pos + 1}"]
        nxt_a = [] if pos == 2 else ["--next", f"{address(pos + 1)}:{AR_PORT + pos + 1}"]
        if pos == 2 and tail:
            specs.append((pos, "tail", tail_port, ["--block", "3", "--checkpoint", str(args.blocks)]))
        specs.append((pos, f"block{pos}", BLOCK_PORT + pos, ["--block", str(pos), "--checkpoint", str(args.blocks)] + nxt_b))
        specs.append((pos, f"ar{pos}", AR_PORT + pos, ["--model", "ar", "--checkpoint", str(args.ar), "--layers-range",
                                                       f"{2 * pos}:{2 * pos + 2}"] + nxt_a
                      + (["--draft", str(args.draft)] if pos == 0 else [])))
    try:
        for pos, name, port, extra in specs:
            procs.append(start_node(["join", "--role", "stage", "--listen", f"0.0.0.0:{port}", "--worker-id", name,
                                     *extra], port_file=workdir / f"{name}.port", log=workdir / f"{name}.log",
                                    popen=popen(pos), timeout_s=180, name=f"stage {name}").proc)
    except BaseException:
        stop_processes(procs)
        raise
    return procs


def run_link(args: argparse.Namespace, link: str, all_modes: list[dict], tail: bool, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = module_command("bench.serving", "--client", "--speed-prompts", str(args.speed_prompts), "--modes-json",
                         json.dumps(all_modes))

    def finish(procs: list[subprocess.Popen], run: list[str]) -> dict:
        try:
            done = subprocess.run(run, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            raise SystemExit(f"the {link} client failed:\n{exc.stderr[-3000:]}") from None
        finally:
            stop_processes(procs)
        return json.loads(done.stdout.strip().splitlines()[-1])

    if link == "loopback":
        procs = start_chains(args, tail, lambda pos: subprocess.Popen, lambda pos: "127.0.0.1", workdir)
        return finish(procs, cmd + ["--entry-block", f"127.0.0.1:{BLOCK_PORT}", "--entry-ar", f"127.0.0.1:{AR_PORT}"])
    from lab.netlab.topology import Chain

    reason = Chain.why_unavailable()
    if reason:
        raise SystemExit(f"cannot emulate the WAN here: {reason}")
    with Chain(4, delay_ms=20, rate_mbit=100) as lab:  # h0 = client, h1..h3 = stage positions 0..2
        procs = start_chains(args, tail, lambda pos: partial(lab.popen, pos + 1), lambda pos: lab.address(pos + 1),
                             workdir)
        return finish(procs, ["ip", "netns", "exec", lab.host(0), *cmd, "--entry-block",
                              f"{lab.address(1)}:{BLOCK_PORT}", "--entry-ar", f"{lab.address(1)}:{AR_PORT}"])


# --- the report ----------------------------------------------------------------------------------


def frontier(all_modes: list[dict], q: dict, real: dict, links: dict) -> list[dict]:
    rows = [{"mode": "real", "k": 0, "n_steps": 0, "n_tail": 0, "link": "none", "bytes_per_s": None,
             "traversals_per_byte": None, **{k: real[k] for k in ("judge_ce", "distinct4", "repeat_frac", "word_rate")}}]
    for m in all_modes:
        s = q[(label(m), 1.0)]
        for link, res in links.items():
            r = res[label(m)]
            rows.append({"mode": m["mode"], "k": m["k"], "n_steps": m["n_steps"], "n_tail": m["n_tail"], "link": link,
                         "readout": m.get("readout"),
                         "label": label(m), "bytes_per_s": r["bytes_per_s"],
                         "traversals_per_byte": r["traversals_per_byte"], "judge_ce": s["judge_ce"],
                         "distinct4": s["distinct4"], "repeat_frac": s["repeat_frac"], "word_rate": s["word_rate"],
                         **{k: s[k] for k in ("acceptance", "pooled_frac") if k in s}})
    return rows


def summary(rows: list[dict], real: dict) -> dict:
    wan = [r for r in rows if r["link"] == "wan"] or [r for r in rows if r["link"] == "loopback"]
    ar = next(r for r in wan if r["mode"] == "ar")
    spec = next(r for r in wan if r["mode"] == "ar_spec")
    ok = [r for r in wan if r["mode"] == "blockwise" and r["judge_ce"] <= ar["judge_ce"] + 0.10
          and r["distinct4"] >= 0.9 * real["distinct4"]]
    best = max(ok, key=lambda r: r["bytes_per_s"]) if ok else None
    # the same bar for the modes that run the diffusion sweep (the "spec" readouts run none), and for
    # readout "spec" alone: every byte it serves is the pooled blocks' (spec-fill's filled bytes are the
    # last block's alone, so at large K it is mostly one block sampled autoregressively)
    swept = [r for r in ok if not (r.get("readout") or "").startswith("spec")]
    best_swept = max(swept, key=lambda r: r["bytes_per_s"]) if swept else None
    pooled = [r for r in ok if r.get("readout") == "spec"]
    best_pooled = max(pooled, key=lambda r: r["bytes_per_s"]) if pooled else None
    return {"judge_ce_real": real["judge_ce"], "judge_ce_ar": ar["judge_ce"], "wan_bytes_per_s_ar": ar["bytes_per_s"],
            "wan_bytes_per_s_ar_spec": spec["bytes_per_s"], "ar_spec_bytes_per_traversal": 1 / spec["traversals_per_byte"],
            "blockwise_speedup_at_ar_quality": best["bytes_per_s"] / ar["bytes_per_s"] if best else 0.0,
            "best_blockwise_at_ar_quality": best["label"] if best else None,
            "blockwise_over_ar_spec_at_ar_quality": best["bytes_per_s"] / spec["bytes_per_s"] if best else 0.0,
            "sweep_speedup_at_ar_quality": best_swept["bytes_per_s"] / ar["bytes_per_s"] if best_swept else 0.0,
            "spec_speedup_at_ar_quality": best_pooled["bytes_per_s"] / ar["bytes_per_s"] if best_pooled else 0.0,
            "best_spec_at_ar_quality": best_pooled["label"] if best_pooled else None,
            "spec_over_ar_spec_at_ar_quality": best_pooled["bytes_per_s"] / spec["bytes_per_s"] if best_pooled else 0.0,
            "best_sweep_at_ar_quality": best_swept["label"] if best_swept else None,
            "speed_link": wan[0]["link"]}


def plot(rows: list[dict], real: dict, path: Path) -> None:
    plt = pyplot("serving")
    if plt is None:
        return
    ar = next(r["judge_ce"] for r in rows if r["mode"] == "ar")
    style = {"pool": ("o", "tab:grey"), "commit": ("D", "tab:orange"), "spec": ("P", "tab:blue"),
             "spec-fill": ("X", "tab:cyan"), "last": ("s", "tab:brown")}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for ax, link in zip(axes, ("wan", "loopback")):
        shown_rows = [r for r in rows if r["link"] == link and r["judge_ce"] <= 2.5]
        for r in shown_rows:
            marker, color = style[r.get("readout") or "pool"] if r["mode"] == "blockwise" else \
                ("^", "tab:red") if r["mode"] == "ar" else ("v", "tab:purple")
            ax.scatter(r["bytes_per_s"], r["judge_ce"], marker=marker, color=color, s=55)
            ax.annotate(r["label"].replace("blockwise ", ""), (r["bytes_per_s"], r["judge_ce"]), fontsize=6.5,
                        xytext=(4, 3), textcoords="offset points")
        ax.axhline(real["judge_ce"], color="grey", linestyle="--", linewidth=1)
        ax.axhline(ar + 0.10, color="tab:red", linestyle=":", linewidth=1)
        ax.text(0.01, real["judge_ce"], " real text", va="bottom", fontsize=8, transform=ax.get_yaxis_transform())
        ax.text(0.01, ar + 0.10, " AR samples + 0.10 (the bar)", va="bottom", fontsize=8, color="tab:red",
                transform=ax.get_yaxis_transform())
        ax.set_xscale("log")
        ax.set_xlabel("bytes/s (log)")
        ax.set_title({"wan": "emulated WAN: 3 hops of 20 ms, 100 Mbit/s", "loopback": "loopback"}[link])
    axes[0].set_ylabel("judge CE of the continuation (nats/byte; lower is better)")
    fig.suptitle("Serving frontier (temperature 1, 256 new bytes). Markers: o pool, D commit, + spec, x spec-fill, "
                 "^ AR plain, v AR speculative.\nRows above 2.5 nats/byte (independent K > 1 readouts: noise) are off "
                 "the chart.", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


QUALITY = ["judge CE", "distinct 4-grams", "repeat frac", "word rate"]  # the judge's columns, in every table


def quality_cells(g: dict) -> tuple[str, ...]:
    return f"{g['judge_ce']:.3f}", f"{g['distinct4']:.3f}", f"{g['repeat_frac']:.3f}", f"{g['word_rate']:.3f}"


def metrics(res: dict) -> dict[str, Metric]:
    """At AR quality: `spec`'s speed over the AR chain and AR speculative; judge CE; WAN bytes/s of AR."""
    s = res["summary"]
    spec = res.get("quality_t1", {}).get("blockwise K=16 spec", {})
    return {"spec / AR bytes/s at AR quality": s.get("spec_speedup_at_ar_quality"),
            "spec / AR speculative at AR quality": s.get("spec_over_ar_spec_at_ar_quality"),
            "best blockwise / AR at AR quality": s.get("blockwise_speedup_at_ar_quality"),
            "sweep / AR at AR quality": s.get("sweep_speedup_at_ar_quality"),
            "judge CE, spec K = 16": spec.get("judge_ce"), "judge CE, AR": s["judge_ce_ar"],
            "AR bytes/s over the WAN": s["wan_bytes_per_s_ar"]}


def render(res: dict) -> str:
    s = res["summary"]
    lines = [
        "## Serving frontier: speed against judged text quality (`bench/serving.py`)",
        "",
        f"Command: `{res['command']}` ({res['date']}; 2 cores). Served models: blocks `{res['blocks']}`, AR "
        f"`{res['ar']}` (plain and speculative, draft `{res['draft']}`, G = {DRAFT_LEN}); judge `{res['judge']}`. "
        f"{res['n_prompts']} fixed prompts of 64 held-out bytes, {N_BYTES} new bytes each, temperature 1 (seed i for "
        f"prompt i); speed over {res['speed_prompts']} of them after a warm-up. Quality comes from the serving code "
        "in one process (the bytes a remote chain returns), speed from real stage processes.",
        "",
        *table(["mode", "link", "bytes/s", "traversals/byte", *QUALITY],
               [(r.get("label", "real text (reference)"), r["link"],
                 "—" if r["bytes_per_s"] is None else f"{r['bytes_per_s']:.1f}",
                 "—" if r["traversals_per_byte"] is None else f"{r['traversals_per_byte']:.3f}", *quality_cells(r))
                for r in res["frontier"]], "llrrrrrr"),
        "", f"Greedy (temperature 0), the first {res['greedy_prompts']} prompts, quality only:", "",
        *table(["mode", *QUALITY], [(name, *quality_cells(g)) for name, g in res["greedy"].items()], "lrrrr"),
    ]
    for key, how in (("composition", "the one block evaluates every grid point; commit readout"),
                     ("composition_spec", "readout spec with the one block in every stage: it drafts and verifies "
                                          "itself, i.e. that block's own autoregressive sampling")):
        if not res.get(key):
            continue
        c, qt = res[key], res["quality_t1"]
        lines += ["", f"Composition for generation: the chain's samples against each block run alone ({how}; "
                  "temperature 1, all prompts):", "",
                  # the chain's row is missing where it ran at other N_s than --alone-steps
                  *table(["sampler", *QUALITY], [(name, *quality_cells(qt[name])) for name in (c["chain"], *c["alone"])
                                                 if name in qt], "lrrrr")]
    spec = [(name, g) for name, g in res["quality_t1"].items() if "acceptance" in g and "alone" not in name]
    if spec:
        lines += ["", "Readout spec (temperature 1, all prompts): the share of block 0's draft bytes the pooled blocks "
                  "kept, the bytes served per traversal, and the share of served bytes that are the pool's (kept, or "
                  "the replacement at a rejection; with spec-fill the rest is filled by the last block alone):", "",
                  *table(["mode", "draft bytes kept", "bytes per traversal", "bytes from the pool", "judge CE"],
                         [(name, f"{g['acceptance']:.3f}", f"{g['bytes_per_traversal']:.2f}", f"{g['pooled_frac']:.3f}",
                           f"{g['judge_ce']:.3f}") for name, g in spec], "lrrrr")]
    lines += ["", "![serving frontier](bench/results/serving_frontier.png)", "",
              f"Over the {s['speed_link']} link: AR plain {s['wan_bytes_per_s_ar']:.1f} bytes/s, AR speculative "
              f"{s['wan_bytes_per_s_ar_spec']:.1f} bytes/s ({s['ar_spec_bytes_per_traversal']:.2f} bytes per traversal). "
              f"`blockwise_speedup_at_ar_quality` = **{s['blockwise_speedup_at_ar_quality']:.2f}** "
              f"({s['best_blockwise_at_ar_quality'] or 'no blockwise mode is within 0.10 nats/byte of the AR chain with ≥ 0.9× the real distinct 4-grams'}; aim ≥ 4); "
              f"against AR speculative {s['blockwise_over_ar_spec_at_ar_quality']:.2f}×. Readout spec alone (every "
              f"byte the pooled blocks'): {s['spec_speedup_at_ar_quality']:.2f} ({s['best_spec_at_ar_quality'] or 'none qualifies'}; "
              f"{s['spec_over_ar_spec_at_ar_quality']:.2f}× AR speculative). Among the modes that run the "
              f"diffusion sweep (all but the spec readouts): {s['sweep_speedup_at_ar_quality']:.2f} "
              f"({s['best_sweep_at_ar_quality'] or 'none qualifies'})."]
    return "\n".join(lines)


def main() -> None:
    ap = BenchParser(__doc__)
    ap.add_argument("--blocks", type=Path, help="block checkpoint folder (scoring blocks, and tail blocks if any)")
    ap.add_argument("--ar", type=Path, help="the B·L-layer AR checkpoint (served plain and speculative)")
    ap.add_argument("--draft", type=Path, help="the AR draft checkpoint (a small model at the entry)")
    ap.add_argument("--judge", type=Path, default=ROOT / "runs" / "judge")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--speed-prompts", type=int, default=2)
    ap.add_argument("--greedy-prompts", type=int, default=8, help="prompts of the greedy (quality-only) table")
    ap.add_argument("--n-steps", default="7,13", help="N_s values of the block chain")
    ap.add_argument("--ks", default="1,4,16,64")
    ap.add_argument("--k1-steps", help="N_s values at K = 1 (default: --n-steps); K = 1 costs 256 sweeps per prompt, "
                                       "so a short run may take fewer")
    ap.add_argument("--tail-steps", type=int, default=8)
    ap.add_argument("--alone-steps", type=int, default=7, help="N_s of the composition rows (each block alone)")
    ap.add_argument("--links", default="loopback,wan")
    ap.add_argument("--readouts", default="pool,commit,spec,spec-fill", help="block-chain readouts to run (pool includes the "
                                                                   "tail rows)")
    ap.add_argument("--spec-ks", default="1,4,8,16,32", help="draft lengths K of readout spec")
    ap.add_argument("--spec-alone-k", type=int, default=16, help="K of the spec composition rows (each block alone)")
    ap.result("serving")
    ap.add_argument("--render-only", action="store_true", help="recompute the summary of --out and rewrite its "
                                                                "plot and BENCHMARKS section (no run)")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--entry-block", help=argparse.SUPPRESS)
    ap.add_argument("--entry-ar", help=argparse.SUPPRESS)
    ap.add_argument("--modes-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print(json.dumps(client({"block": args.entry_block, "ar": args.entry_ar}, args.modes_json, args.speed_prompts)))
        return
    if args.render_only:
        res = json.loads(args.results.read_text())
        res["summary"] = summary(res["frontier"], res["real"])
        res.update(res["summary"])
        finish(args, res)
        return
    if not (args.blocks and args.ar and args.draft):
        raise SystemExit("--blocks, --ar and --draft are required (see the docstring for how they are made)")
    from btnode.store.models import load_blocks

    cfg, _ = load_blocks(args.blocks)
    readouts = args.readouts.split(",")
    all_modes = modes(cfg, [int(x) for x in args.n_steps.split(",")], [int(x) for x in args.ks.split(",")],
                      args.tail_steps, [int(x) for x in args.k1_steps.split(",")] if args.k1_steps else None,
                      tuple(readouts), tuple(int(x) for x in args.spec_ks.split(",")))
    k_big = max((k for k in cfg.segments if k > 1), default=0)
    alone = [{"mode": "blockwise", "k": k_big, "n_steps": args.alone_steps, "n_tail": 0, "readout": "commit",
              "alone": b} for b in range(cfg.n_blocks)] if k_big and "commit" in readouts else []
    spec_alone = [{"mode": "blockwise", "k": args.spec_alone_k, "n_steps": min(int(x) for x in args.n_steps.split(",")),
                   "n_tail": 0, "readout": "spec", "alone": b} for b in range(cfg.n_blocks)] \
        if "spec" in readouts else []
    q, real = quality(args, all_modes + alone + spec_alone)
    workdir = Path(tempfile.mkdtemp(prefix="btnode-serving-"))
    links = {link: run_link(args, link, all_modes, bool(cfg.tail_blocks), workdir / link)
             for link in args.links.split(",")}
    rows = frontier(all_modes, q, real, links)
    res = {"command": invoked(), "date": time.strftime("%Y-%m-%d"),
           "blocks": shown([str(args.blocks)]), "ar": shown([str(args.ar)]), "draft": shown([str(args.draft)]),
           "judge": shown([str(args.judge)]), "n_prompts": args.prompts, "speed_prompts": args.speed_prompts,
           "greedy_prompts": args.greedy_prompts,
           "n_bytes": N_BYTES, "frontier": rows, "summary": summary(rows, real), "links": links,
           "greedy": {name: v for (name, t), v in q.items() if t == 0.0},
           "composition": {"chain": label({k: v for k, v in alone[0].items() if k != "alone"}),
                           "alone": [label(m) for m in alone]} if alone else None,
           "composition_spec": {"chain": label({k: v for k, v in spec_alone[0].items() if k != "alone"}),
                                "alone": [label(m) for m in spec_alone]} if spec_alone else None,
           "quality_t1": {name: v for (name, t), v in q.items() if t == 1.0}, "real": real}
    res.update(res["summary"])
    finish(args, res)


def finish(args: argparse.Namespace, res: dict) -> None:
    if is_published(args.results):
        plot(res["frontier"], res["real"], RESULTS / "serving_frontier.png")
    publish("serving", res, metrics(res), render, out=args.results)
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
