"""A multi-turn trajectory's indexer selections, turn by turn: `SelectionTurns`.

Routes cross the wire once per row (the client sends a start field), but
SGLang has no start field for `indexer_topk`: every turn returns the rows of
every position it evaluated, from 0. So turn `t`'s selections cover every
earlier turn's rows, and the trajectory's selections are simply the latest
turn's, provided the rows it resends are the ones the earlier turns sent.
`SelectionTurns` holds one compact `IndexerSelections` (the latest; memory
stays one trajectory's compact form however many turns there are) and, per
turn, compares the resent rows with the held ones (their codes as bytes, which
is cheap; rows are decoded only where codes differ).

What to do when they differ is the caller's choice: `"check"` refuses the
turn; `"latest"` keeps the newer rows and counts the rows that changed. The
engine recomputes a prefix it did not cache, with other batch neighbours and
kernels, so a changed row is possible without any bug; which version the
trainer should replay is not obvious (the older one shaped the earlier turn's
sampling, the newer one the keys the later turn attended to), and the default
is to say so rather than pick.

`torch_r3.RoutedExpertTrace(resent_selections=)` uses this class; it is
public for callers that keep routes elsewhere.
"""

from __future__ import annotations

from torch_r3._checks import check_choice, check_non_negative
from torch_r3.selections import IndexerSelections

__all__ = ["RESENT_SELECTIONS", "SelectionTurns"]

#: What `SelectionTurns(resent=)` does with a turn whose resent rows differ from the held ones:
#: refuse the turn (`"check"`), or keep the latest turn's rows (`"latest"`).
RESENT_SELECTIONS = ("check", "latest")


class SelectionTurns:
    """The indexer selections of one trajectory's turns so far (see the module docstring).

    Args:
        resent: `"check"` or `"latest"` (`RESENT_SELECTIONS`).
        name: What to call the trajectory in messages.

    Examples:
        >>> import numpy as np
        >>> turns = SelectionTurns()
        >>> turns.add(IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 0]]])), rows=3)
        >>> turns.add(IndexerSelections.from_dense(np.array([[[0, -1]], [[0, 1]], [[2, 0]], [[3, 1]]])), rows=4)
        >>> turns.selections.shape, turns.turns
        ((4, 1, 2), 2)
    """

    def __init__(self, *, resent: str = "check", name: str = "trajectory") -> None:
        self.resent = check_choice(resent, "resent_selections", RESENT_SELECTIONS)
        self.name = name
        self.selections: IndexerSelections | None = None
        self.turns = 0
        self.changed = 0

    def check(self, selections: object, *, rows: int, turn: str = "turn") -> int:
        """Check a turn's selections without keeping them; returns how many held rows they change.

        Args:
            selections: The turn's `IndexerSelections` (e.g.
                `RemoteGenerateResult.indexer_topk`), rows from position 0.
            rows: The rows the turn must carry: every position evaluated so
                far (`prompt_len + generated_len - 1`).
            turn: What to call the turn in messages.

        Raises:
            TypeError: not `IndexerSelections`.
            ValueError: the wrong row count, other layers or `index_topk` than
                the earlier turns, or (with `"check"`) a resent row that
                selects other positions than before.
        """
        rows = check_non_negative(rows, f"{turn}: rows")
        if not isinstance(selections, IndexerSelections):
            raise TypeError(
                f"{self.name} {turn}: indexer_topk must be IndexerSelections (RemoteGenerateResult.indexer_topk), "
                f"got {type(selections).__name__}"
            )
        if selections.rows != rows:
            raise ValueError(
                f"{self.name} {turn}: indexer_topk has {selections.rows} rows, expected {rows} (SGLang sends the "
                "selections of every evaluated position, from 0, each turn)"
            )
        held = self.selections
        if held is None:
            return 0
        if selections.shape[1:] != held.shape[1:]:
            raise ValueError(
                f"{self.name} {turn}: indexer_topk is [layers={selections.num_layers}, index_topk="
                f"{selections.index_topk}], earlier turns [{held.num_layers}, {held.index_topk}]"
            )
        if held.rows > rows:
            raise ValueError(f"{self.name} {turn}: {rows} indexer rows, fewer than the {held.rows} held")
        changed = held.differing_rows(selections, held.rows)
        if changed.size and self.resent == "check":
            raise ValueError(
                f"{self.name} {turn}: the engine resent {changed.size} indexer row(s) with other positions than "
                f"an earlier turn sent (the first: row {int(changed[0])}): it recomputed a prefix it had not "
                "cached. Drop the trajectory, or pass resent_selections='latest' to keep the latest turn's rows"
            )
        return int(changed.size)

    def add(self, selections: object, *, rows: int, turn: str = "turn") -> None:
        """Check (as `check`) and keep a turn's selections; on an error nothing changes."""
        self.keep(selections, self.check(selections, rows=rows, turn=turn))

    def keep(self, selections: object, changed: int) -> None:
        """Keep selections `check` passed, which changed `changed` held rows (`check`'s answer)."""
        if not isinstance(selections, IndexerSelections):
            raise TypeError(f"selections must be IndexerSelections, got {type(selections).__name__}")
        self.selections = selections
        self.turns += 1
        self.changed += check_non_negative(changed, "changed")
