"""One generation request's settings as a frozen value: `btnode generate`, the gRPC entry and its
client (rpc/stages.py) and the entry's loop (serve/driver.py) pass this one object, and
`GenerationRequest.checked` is the one place its settings are checked against a model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from btnode.errors import InputError
from btnode.model.config import ModelConfig
from btnode.model.readout import Readout
from btnode.serve.defaults import ServingDefaults, serving_defaults


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate and how. None and 0 leave a setting to its default, which `checked` fills
    in for the chain that serves it. The block-chain settings are ignored by the AR chain and
    `draft_len` by the block chain. `readout` may be given as its string (parsed, InputError)."""

    prompt: bytes  # empty: start after a newline
    n_bytes: int  # new bytes to generate
    seed: int = 0  # keys the noise and sampling streams: the same request gives the same bytes anywhere
    temperature: float = 0.0  # 0 = argmax
    k: int | None = None  # block chain: bytes per segment, or for SPEC… the draft length (None: the serving default)
    n_steps: int | None = None  # block chain: sampler grid points per segment (None: the serving default, 2B + 1)
    readout: Readout | None = None  # block chain (None: the serving default, serve/defaults.py; LAST with n_tail)
    n_tail: int = 0  # block chain: grid points below σ_lo, run by the tail blocks
    want_logits: bool = False  # block chain: return the (K, V) log-probs each segment was sampled from
    use_cache: bool = True  # block chain: False makes every stage rebuild its clean stream (same bytes, slower)
    draft_len: int = 0  # AR chain: G draft bytes verified per traversal (0: plain decoding)
    request_id: str | None = None  # keys the stages' caches (None: a fresh uuid)

    def __post_init__(self) -> None:
        if self.readout is not None:
            object.__setattr__(self, "readout", Readout.parse(self.readout))

    def checked(self, cfg: ModelConfig, n_blocks: int | None = None,
                defaults: ServingDefaults | None = None) -> GenerationRequest:
        """This request as a chain of this model serves it, defaults filled in; InputError for a
        setting it cannot serve. n_blocks: the block chain's B scoring blocks; None: the AR chain.
        defaults: the chain's serving defaults (None: `serving_defaults(cfg)`, the measured ones)."""
        # imported here: the request value itself stays free of torch (the HTTP proxy, node/api.py)
        from btnode.model.noise import default_steps
        from btnode.serve.ar import MAX_DRAFT, max_draft
        from btnode.serve.context_cache import MAX_REQUEST_ID
        from btnode.serve.stages import check_request, check_temperature

        if n_blocks is None:
            if len(self.prompt) > cfg.context:
                raise InputError(f"prompt is {len(self.prompt)} bytes; the context is {cfg.context} bytes")
            if not 0 <= self.draft_len <= max_draft(cfg):
                raise InputError(f"draft length G={self.draft_len} is out of range: this model verifies 0 ≤ G ≤ "
                                 f"{max_draft(cfg)} bytes per traversal (G ≤ {MAX_DRAFT} and G < N/2 = "
                                 f"{cfg.context // 2}; 0 = plain decoding)")
            check_temperature(self.temperature)  # before a draft samples with it
            out = self
        else:
            d = defaults or serving_defaults(cfg)
            readout = self.readout or (Readout.LAST if self.n_tail else d.readout)
            k = self.k
            if k is None:  # the default K where the readout can serve it, else the largest trained K
                k = d.k if (1 <= d.k <= cfg.context // 2 if readout.drafts else d.k in cfg.segments) \
                    else max(cfg.segments)
            steps = self.n_steps or (d.n_steps if readout is d.readout else None) or default_steps(cfg)
            out = dataclasses.replace(self, k=k, n_steps=steps, readout=readout)
            check_request(cfg, n_blocks, out.prompt, out.k, out.n_steps, out.readout, out.n_tail)  # type: ignore[arg-type]
        if self.n_bytes < 1:
            raise InputError(f"asked for {self.n_bytes} bytes")
        if self.request_id is not None and len(self.request_id) > MAX_REQUEST_ID:
            raise InputError(f"request id of {len(self.request_id)} characters; at most {MAX_REQUEST_ID}")
        return out
