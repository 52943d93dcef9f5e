"""The rows of a run's cost summary and how they print (`trainwise.cost_summary`).

A `CostRow` is one line of the screen (a market, a use, a subtotal, the saving, the data
skipped); `CostSummary` holds them with the bill and prints them as text, markdown (the MLflow
artifact) and Dagster metadata, rounding so that each section adds up to the bill to the cent.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

SUPERVISED_FILE = "supervised.json"  # trainwise.supervised_run.RECORD_FILE
GANG_FILE = "gang.json"  # trainwise.gang.GANG_FILE
PROVIDER_RANK = 1000  # the provider's telemetry rank (trainwise.gang / trainwise.emulated)
NOT_RECORDED = "not recorded"
# Saves a trainer makes after it was told to stop (billed inside the notice time) and at the end.
AFTER_NOTICE_SAVES = {"preemption", "migrate_fallback"}
FINAL_SAVE = "final"
MARKET, USE, SUBTOTAL, AGAINST, DATA = "market", "use", "subtotal", "against", "data"
KNOWN = "known"  # what a run without a bill still tells


@dataclass(frozen=True)
class CostRow:
    key: str  # the metadata name, e.g. "notice"
    name: str
    section: str  # MARKET, USE (these two each add up to the bill), SUBTOTAL, AGAINST, DATA
    node_s: float | None
    usd: float | None
    share_of_bill: float | None
    caused_by: str
    why_missing: str = ""  # why node_s or usd is None
    waste: bool = False  # part of the bill's preemption waste (beyond the fixed schedule)
    share_of_fixed: float | None = None  # the saving row: its share of the fixed schedule


@dataclass(frozen=True)
class CostSummary:
    run_id: str
    run_dir: str
    engine: str  # "supervised", "in-process", "node-agent", or "" without a bill
    bill_usd: float | None
    bill_source: str  # the file the bill was read from, or why there is none
    rows: tuple[CostRow, ...]
    preemptions: int  # the trainer's preemption events (rank 0) in the telemetry
    notes: tuple[str, ...] = ()

    def row(self, key: str) -> CostRow:
        return next(r for r in self.rows if r.key == key)

    def money_rows(self, section: str) -> list[CostRow]:
        return [r for r in self.rows if r.section == section]

    @property
    def productive_share(self) -> float | None:
        return self.row("productive").share_of_bill if self.bill_usd is not None else None

    def markdown(self) -> str:
        """The table, for an MLflow artifact."""
        lines = [f"# Where every dollar went: run {self.run_id}", "", self._headline(), "",
                 "| section | item | node-s | USD | share of bill | caused by |",
                 "|---|---|---:|---:|---:|---|"]
        for row, cents in zip(self.rows, self._shown_cents(), strict=True):
            lines.append(f"| {row.section} | {row.name} | {_node_s(row)} | {_usd(row, cents)} | "
                         f"{_share(row)} | {_cell(row)} |")
        return "\n".join(lines + [""] + [f"- {n}" for n in self.notes])

    def text(self) -> str:
        """The CLI screen: one table a CFO can read, each row's causes on the line below it."""
        width = 40
        out = [self._headline(), ""]
        titles = {MARKET: "by market (adds up to the bill)", USE: "by use (adds up to the bill)",
                  SUBTOTAL: "", AGAINST: "against the fixed on-demand schedule",
                  DATA: "data selection", KNOWN: "known without a bill"}
        section = None
        for row, cents in zip(self.rows, self._shown_cents(), strict=True):
            if row.section != section and titles[row.section]:
                out.append(f"{titles[row.section]:<{width}} {'node-s':>10} {'USD':>12} "
                           f"{'share':>7}")
            section = row.section
            name = ("  of which " if row.section == SUBTOTAL else "  ") + row.name
            out.append(f"{name:<{width}} {_node_s(row):>10} {_usd(row, cents):>12} "
                       f"{_share(row):>7}")
            out += textwrap.wrap(_cell(row), 100, initial_indent=" " * 6,
                                 subsequent_indent=" " * 6, max_lines=2, placeholder=" ...")
        if self.bill_usd is not None and self.productive_share is not None:
            out.append(f"\nproductive training: {self.productive_share:.1%} of the bill")
        return "\n".join(out + [f"note: {n}" for n in self.notes])

    def metadata(self) -> dict[str, float | str]:
        """Flat figures for Dagster asset metadata (floats and strings only)."""
        found: dict[str, float | str] = {"cost/engine": self.engine or "none",
                                         "cost/bill_source": self.bill_source,
                                         "cost/preemptions": float(self.preemptions)}
        if self.bill_usd is not None:
            found["cost/bill_usd"] = self.bill_usd
        for row in self.rows:
            for suffix, value in (("node_s", row.node_s), ("usd", row.usd),
                                  ("share", row.share_of_bill),
                                  ("share_of_fixed", row.share_of_fixed)):
                if value is not None:
                    found[f"cost/{row.key}_{suffix}"] = float(value)
            if row.why_missing:
                found[f"cost/{row.key}_missing"] = row.why_missing
        return found

    def _headline(self) -> str:
        if self.bill_usd is None:
            return (f"run {self.run_id}: NO BILL RECORDED, so where its dollars went is not "
                    "known; what its folder does tell:")
        billed = sum(r.node_s or 0.0 for r in self.money_rows(MARKET))
        return (f"run {self.run_id}: where every dollar went ({self.engine} engine, bill from "
                f"{self.bill_source}): {self.bill_usd:,.2f} USD for {billed:,.0f} node-s")

    def _shown_cents(self) -> list[int | None]:
        """Each row's USD in cents; in the two sections that add up to the bill, rounded so the
        shown cents add up to the shown bill (the closing row takes the rounding)."""
        shown: list[int | None] = [None if r.usd is None else round(r.usd * 100) for r in self.rows]
        if self.bill_usd is None:
            return shown
        for section in (MARKET, USE):
            index = [i for i, r in enumerate(self.rows) if r.section == section]
            if index:
                last = index[-1]
                others = sum(shown[i] or 0 for i in index[:-1])
                shown[last] = round(self.bill_usd * 100) - others
        return shown


def _node_s(row: CostRow) -> str:
    return "n/a" if row.node_s is None else f"{row.node_s:,.0f}"


def _usd(row: CostRow, cents: int | None) -> str:
    if row.section == DATA or (row.section == KNOWN and row.usd is None):
        return "-"
    if cents is None:
        return NOT_RECORDED
    # Less than a cent but not nothing: say so rather than print a 0 (it adds 0 cents).
    return "<0.01" if cents == 0 and (row.usd or 0.0) > 0 else f"{cents / 100:,.2f}"


def _share(row: CostRow) -> str:
    share = row.share_of_bill if row.share_of_fixed is None else row.share_of_fixed
    return "" if share is None else f"{share:.1%}"


def _cell(row: CostRow) -> str:
    missing = f"[{NOT_RECORDED}: {row.why_missing}]" if row.why_missing else ""
    return " ".join(part for part in (row.caused_by, missing) if part)


# -- the bill's parts, as the engines recorded them ---------------------------------------------
