"""Per-block records of a speculative generation, and the summary numbers derived from them.

Conventions (DEVELOPERS.md): a *block* is one draft-then-verify round. It yields the accepted draft
tokens plus one token from the target: the *recovered* token after a rejection, or the *bonus*
token when all gamma drafts are accepted. Block efficiency ``tau`` counts that target token
(``1 <= tau <= gamma + 1``, but for a constrained request, whose forced tails ride below the
drafted nodes: docs/structured.md); ``mean_accepted_length = tau - 1`` does not. When the output is cut
by EOS or ``max_new_tokens`` inside a block, the block counts only the tokens actually emitted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class BlockRecord:
    """One draft-then-verify round."""

    n_drafted: int  # draft tokens proposed: tree nodes, root excluded (a chain: gamma, fewer near the end)
    n_accepted: int  # draft tokens accepted by verification (the depth of the accepted path)
    n_emitted: int  # tokens appended to the output by this block (after any EOS / limit cut)
    draft_s: float = 0.0  # the block's step: its drafting (eager) or its whole graph's replay (CUDA graphs)
    verify_s: float = 0.0  # the rest of the step: target forward + acceptance (eager) or the one host read (graphs)
    depth: int | None = None  # the deepest draft position of the block; None: n_drafted (a chain)

    @property
    def drafted_depth(self) -> int:
        return self.n_drafted if self.depth is None else self.depth


@dataclass
class GenerationStats:
    """Summary of one ``SpecDecoder.generate`` call. Times are wall-clock seconds."""

    gamma: int  # the deepest a block drafts: gamma for a chain, the tree's depth for a tree
    views: tuple[str, ...]
    tree: str = "chain"  # the block shape (TreeSpec.label)
    engine: str = "eager"  # "eager", "static" (fixed shapes) or "cuda-graphs"
    capture_s: float = 0.0  # CUDA-graph warm-up + capture inside this call (first calls of a shape)
    compile_s: float = 0.0  # torch.compile's first calls of a shape inside this call (within capture_s with graphs)
    acceptance: str = "exact"  # "exact" (lossless) or "relaxed (lossy)"
    weighting: str = "fixed"  # the ensemble's weights: "fixed", or the adaptive rule ("adaptive", "adaptive:loglik")
    view_weights: list[list[float]] = field(default_factory=list)  # adaptive: the weights each drafted block mixed with
    final_weights: list[float] | None = None  # adaptive: the weights after the last block (a next turn's start)
    shapes: dict[str, int] = field(default_factory=dict)  # tree="auto": steps this request drafted, per block shape
    shape_rates: dict | None = None  # tree="auto": SpeculationPolicy.report() when it ended (per batch size and shape)
    blocks: list[BlockRecord] = field(default_factory=list)
    vision_s: float = 0.0  # image encoding (vision tower + projectors; shared when reused)
    caption_s: float = 0.0  # captioner, once per image, at prefill
    substitute_s: float = 0.0  # substitute view: making each video's substitute (events, ...) and encoding it
    prefill_target_s: float = 0.0
    prompt_tokens_reused: int = 0  # prompt positions the target did not prefill again (prefix caching)
    prefill_draft_s: float = 0.0
    total_s: float = 0.0
    constraint: str | None = None  # the request's constraint kind (json_schema, regex, ...); None: free text
    forced_tokens: int = 0  # constrained: emitted tokens that were the grammar's only legal token there
    tail_tokens: int = 0  # constrained: emitted tokens verified as a forced tail (after a leaf, never drafted)
    grammar_s: float = 0.0  # constrained: host seconds of grammar work (tree masks, advancing the matcher)

    @property
    def forced_share(self) -> float:
        """The share of the emitted tokens the grammar forced (0 for free text)."""
        n = sum(b.n_emitted for b in self.blocks)
        return self.forced_tokens / n if n else 0.0

    @property
    def tail_share(self) -> float:
        """The share of the emitted tokens that rode as forced tails, without a draft position."""
        n = sum(b.n_emitted for b in self.blocks)
        return self.tail_tokens / n if n else 0.0

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def tokens_per_block(self) -> list[int]:
        return [b.n_emitted for b in self.blocks]

    @property
    def n_tokens(self) -> int:
        return sum(self.tokens_per_block)

    @property
    def tau(self) -> float:
        """Block efficiency: mean tokens produced per block, bonus/recovered token included."""
        return self.n_tokens / self.n_blocks if self.blocks else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau - 1: mean accepted draft tokens per block (EAGLE-family convention)."""
        return self.tau - 1.0 if self.blocks else 0.0

    @property
    def draft_s(self) -> float:
        return sum(b.draft_s for b in self.blocks)

    @property
    def verify_s(self) -> float:
        return sum(b.verify_s for b in self.blocks)

    @property
    def prefill_s(self) -> float:
        return self.prefill_target_s + self.prefill_draft_s

    def acceptance_by_position(self) -> list[float]:
        """P(draft depth i + 1 accepted | the block drafted that deep), i = 0..gamma-1."""
        hits = [0] * self.gamma
        tries = [0] * self.gamma
        for b in self.blocks:
            for i in range(min(b.drafted_depth, self.gamma)):
                tries[i] += 1
                hits[i] += int(i < b.n_accepted)
        return [h / t if t else 0.0 for h, t in zip(hits, tries)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            n_blocks=self.n_blocks,
            n_tokens=self.n_tokens,
            tau=self.tau,
            mean_accepted_length=self.mean_accepted_length,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            acceptance_by_position=self.acceptance_by_position(),
        )
        return d
