"""The run's corpus mixture planned before training: each source's share per curriculum stage, the
tokens the run's budget draws from it, the epochs that implies, and the repetition caps.

Weights are shares of training **tokens** (not documents): a source of long documents and one of
short ones at 0.5/0.5 give each half of the tokens. A source's raw weight in a stage is the stage's
``weights[name]`` if set, else its ``data.sources`` weight (1 when not given), times its size in
tokens to the power ``data.size_alpha`` when that is set; a stage's shares are its raw weights
normalised.

Budget: a stage draws ``steps x global_batch_size x seq_len`` tokens (the rows are packed full; the
few padded rows at a source's epoch end make it an upper bound). Available: a source's document
tokens plus one separator per document, what one epoch of it yields.

Repetition cap (``max_epochs``): a source whose draws would exceed ``max_epochs`` epochs gets the
share that draws exactly that many, in every stage in proportion to its targets; the other sources
of each stage share the rest in their own proportions (repeated until no source is over its cap). A
run that needs more than the caps allow in some stage is refused before it starts. The loader also
never starts an epoch past a source's cap (rounded up), so the cap holds even if the budget estimate
is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from data_pipeline.mixture import Source
from roformer_dist.config import Config, training_sources
from roformer_dist.errors import ConfigError

__all__ = ["SourcePlan", "MixturePlan", "plan_mixture"]


@dataclass(frozen=True)
class SourcePlan:
    name: str
    tokens: int
    """Tokens one epoch of the source yields (documents + their separators)."""
    targets: tuple[float, ...]
    """Share of each stage from the weights alone."""
    shares: tuple[float, ...]
    """Share of each stage after the repetition caps."""
    draws: float
    """Tokens the run's budget draws from it."""
    max_epochs: Optional[float]
    capped: bool
    """Its share was lowered to keep it within max_epochs."""
    shards: str = ""
    """Where its shard set is (``data.sources[].shards``)."""

    @property
    def epochs(self) -> float:
        return self.draws / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class MixturePlan:
    sources: tuple[SourcePlan, ...]
    stage_names: tuple[str, ...]
    budgets: tuple[int, ...]
    """Tokens each stage draws."""

    def loader_sources(self, manifests: dict) -> list[Source]:
        """The sources as the loader's :class:`~data_pipeline.mixture.Source` s, with the manifests the resolved run
        read and checked (by name; the loader reads no other)."""
        return [Source(s.name, s.shards, s.max_epochs, manifests.get(s.name)) for s in self.sources]

    def stage_weights(self, index: int) -> dict[str, float]:
        """Source name -> share in stage ``index`` (what the loader is given)."""
        return {s.name: s.shares[index] for s in self.sources}

    def window_scalars(self, totals: dict[str, float], before: dict[str, float], index: int) -> dict[str, float]:
        """``data/<name>/tokens|share|target``: each source's tokens so far (``totals``, the whole job's), its
        share of the tokens since ``before`` (the totals at the last log step) and its target in stage ``index``."""
        window = {n: totals[n] - before.get(n, 0.0) for n in totals}
        spent = sum(window.values()) or 1.0
        target = self.stage_weights(index)
        out = {}
        for n in totals:
            out.update({f"data/{n}/tokens": totals[n], f"data/{n}/share": window[n] / spent,
                        f"data/{n}/target": target[n]})
        return out

    @property
    def overall(self) -> dict[str, float]:
        """Source name -> share of the whole run's tokens."""
        total = sum(self.budgets) or 1
        return {s.name: s.draws / total for s in self.sources}

    def warnings(self) -> list[str]:
        out = []
        for s in self.sources:
            if s.capped:
                out.append(f"data.sources: {s.name!r} is capped at max_epochs {s.max_epochs:g}: its share goes from "
                           f"{_shares(s.targets)} to {_shares(s.shares)} (by stage) and the other sources share the "
                           "rest")
        return out

    def table(self) -> str:
        stages = "/".join(self.stage_names)
        head = (f"corpus mixture: {len(self.sources)} sources, {sum(self.budgets) / 1e6:.3f} M tokens over "
                f"{len(self.budgets)} stage(s) ({stages})")
        rows = [("source", "tokens", "target share", "share", "draws", "epochs", "")]
        for s in self.sources:
            note = f"capped (max_epochs {s.max_epochs:g})" if s.capped else (
                f"max_epochs {s.max_epochs:g}" if s.max_epochs is not None else "")
            rows.append((s.name, f"{s.tokens / 1e6:.3f} M", _shares(s.targets), _shares(s.shares),
                         f"{s.draws / 1e6:.3f} M", f"{s.epochs:.2f}", note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([head, *lines])


def _shares(values) -> str:
    return "/".join(f"{v:.3f}" for v in values)


def plan_mixture(cfg: Config, manifests: dict[str, dict]) -> MixturePlan:
    """The plan of ``cfg``'s mixture from each source's manifest (name -> manifest); ConfigError when
    the caps cannot hold the budget."""
    sources = training_sources(cfg.data)
    stages = cfg.curriculum.stages
    budgets = tuple(st.steps * st.global_batch_size * st.seq_len for st in stages)
    tokens = {s.name: int(manifests[s.name]["num_tokens"]) + int(manifests[s.name]["num_docs"]) for s in sources}
    alpha = cfg.data.size_alpha
    targets: list[dict[str, float]] = []
    for i, st in enumerate(stages):
        raw = {}
        for s in sources:
            w = st.weights.get(s.name, s.weight if s.weight is not None else 1.0)
            raw[s.name] = w * (tokens[s.name] ** alpha if alpha is not None else 1.0)
        total = sum(raw.values())
        if total <= 0:
            raise ConfigError(f"curriculum.stages[{i}].weights: every source of stage {st.name!r} has weight 0")
        targets.append({n: w / total for n, w in raw.items()})
    caps = {s.name: s.max_epochs * tokens[s.name] for s in sources if s.max_epochs is not None}
    factor: dict[str, float] = {}     # capped source -> its shares / its targets
    while True:
        shares = _capped_shares(targets, factor)
        draws = {n: sum(sh[n] * b for sh, b in zip(shares, budgets)) for n in tokens}
        over = [n for n in caps if n not in factor and draws[n] > caps[n] * (1 + 1e-9)]
        if not over:
            break
        for n in over:
            factor[n] = caps[n] / sum(t[n] * b for t, b in zip(targets, budgets))
    for i, sh in enumerate(shares):
        if sum(sh.values()) < 1 - 1e-6:
            raise ConfigError(
                f"data.sources: stage {stages[i].name!r} draws {budgets[i] / 1e6:.3f} M tokens, more than the "
                f"max_epochs caps of its sources allow; raise a cap, add a source or shorten the stage")
    plans = tuple(SourcePlan(s.name, tokens[s.name], tuple(t[s.name] for t in targets),
                             tuple(sh[s.name] for sh in shares), draws[s.name], s.max_epochs, s.name in factor,
                             s.shards)
                  for s in sources)
    return MixturePlan(plans, tuple(st.name for st in stages), budgets)


def _capped_shares(targets: list[dict[str, float]], factor: dict[str, float]) -> list[dict[str, float]]:
    out = []
    for t in targets:
        fixed = {n: t[n] * f for n, f in factor.items()}
        rest = sum(w for n, w in t.items() if n not in factor)
        left = max(0.0, 1.0 - sum(fixed.values()))
        out.append({n: fixed[n] if n in factor else (w * left / rest if rest > 0 else 0.0) for n, w in t.items()})
    return out



