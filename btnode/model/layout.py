"""Sequence layout of a block's noisy stream and its attention mask (design §2.4).

Noisy position t carries z_t (a noised E[x_{t+1}]) and belongs to segment g(t); c(t) is the last
clean position its segment may see: the position just before the segment's first target, which
is the segment's first noisy position. Noisy t attends to clean j ≤ c(t) and to noisy j with
g(j) = g(t). The clean stream is plain causal and never sees the noisy stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    """Describes the noisy positions a block evaluates.

    positions: (T,) absolute position t of each noisy row (indexes the position tables)
    context_end: (T,) c(t), the last clean position visible to row t
    segment: (T,) g(t), rows sharing a segment see each other
    """

    positions: torch.Tensor
    context_end: torch.Tensor
    segment: torch.Tensor

    @property
    def offsets(self) -> torch.Tensor:
        """t − c(t): how far ahead of the visible context each row predicts (0-based)."""
        return self.positions - self.context_end

    def to(self, device: torch.device | str) -> Layout:
        return Layout(self.positions.to(device), self.context_end.to(device), self.segment.to(device))

    def mask(self, n_clean: int) -> torch.Tensor | None:
        """(T, n_clean + T) bool, True = may attend; None when every row may see everything."""
        full_context = bool((self.context_end >= n_clean - 1).all())
        one_segment = bool((self.segment == self.segment[0]).all())
        if full_context and one_segment:
            return None
        clean = torch.arange(n_clean, device=self.context_end.device)
        sees_clean = clean[None, :] <= self.context_end[:, None]  # (T, n_clean)
        sees_noisy = self.segment[None, :] == self.segment[:, None]  # (T, T)
        return torch.cat([sees_clean, sees_noisy], dim=1)


def window_layout(n: int, k: int, phase: int, start: int = 0, stop: int | None = None) -> Layout:
    """Layout for noisy positions [start, stop) of an n-byte window cut into segments of k.

    Segments start at every t with (t − phase) % k == 0, plus t = 0 (a partial first segment).
    """
    if not 1 <= k <= n or not 0 <= phase < k:
        raise ValueError(f"bad segment layout: k={k}, phase={phase}, n={n}")
    stop = n if stop is None else stop
    t = torch.arange(start, stop)
    seg = torch.div(t - phase, k, rounding_mode="floor")
    first = (phase + seg * k).clamp(min=0)
    return Layout(positions=t, context_end=first, segment=seg)


def eval_layout(n: int, k: int) -> Layout:
    """The scored positions t ∈ [n/2, n), with a segment boundary at n/2 so every scored row
    has at least n/2 bytes of context and the rows are the same for every k."""
    half = n // 2
    return window_layout(n, k, phase=half % k, start=half, stop=n)


def generation_layout(n_context: int, k: int) -> Layout:
    """One segment of k new bytes after n_context clean bytes: rows t = n_context−1 … +k−1."""
    t = torch.arange(n_context - 1, n_context - 1 + k)
    return Layout(positions=t, context_end=torch.full_like(t, n_context - 1), segment=torch.zeros_like(t))


@dataclass(frozen=True)
class RowLayout(Layout):
    """A Layout per batch row, for requests batched at different context lengths (serve/batching.py):
    positions, context_end and segment are (B, T); the cache's row b is valid below its own length
    and padded above it, which context_end keeps every row from seeing."""

    def to(self, device: torch.device | str) -> RowLayout:
        return RowLayout(self.positions.to(device), self.context_end.to(device), self.segment.to(device))

    def mask(self, n_clean: int) -> torch.Tensor:
        """(B, 1, T, n_clean + T) bool, True = may attend (broadcast over heads)."""
        clean = torch.arange(n_clean, device=self.context_end.device)
        sees_clean = clean[None, None, :] <= self.context_end[:, :, None]  # (B, T, n_clean)
        sees_noisy = self.segment[:, None, :] == self.segment[:, :, None]  # (B, T, T)
        return torch.cat([sees_clean, sees_noisy], dim=2)[:, None]


def row_layouts(n_context: torch.Tensor, k: int, *, own_segments: bool = False) -> RowLayout:
    """Per row b, `generation_layout(n_context[b], k)`: rows n_context[b] − 1 … + k − 1 after the
    row's context. own_segments: every row its own segment, seeing the clean context up to its own
    position (the draft scoring of serve/readouts.py, `window_layout(…, 1, 0, start=n − 1)`)."""
    t = n_context[:, None] - 1 + torch.arange(k, device=n_context.device)[None, :]  # (B, k)
    if own_segments:
        return RowLayout(positions=t, context_end=t, segment=torch.arange(k, device=t.device).expand_as(t))
    return RowLayout(positions=t, context_end=(n_context[:, None] - 1).expand_as(t), segment=torch.zeros_like(t))
