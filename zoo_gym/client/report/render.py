"""A statement for people (a table, an HTML page with a plot) and for programs (JSON, CSV)."""

from __future__ import annotations

import csv
import html
import io
import json
import math
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from rich.console import JustifyMethod
from rich.table import Table

from zoo_gym.client.report.statement import AMOUNT_PLACES, RoundLine, Statement
from zoo_gym.client.report.verify import Verification


def exact(amount: Decimal) -> str:
    """An amount with all 9 places, as the ledger stores it."""
    return f"{amount:.{AMOUNT_PLACES}f}"


def money(amount: Decimal) -> str:
    """An amount for people: at least 2 places, no trailing zeros beyond them."""
    whole, _, places = exact(amount).partition(".")
    return f"{whole}.{places.rstrip('0').ljust(2, '0')}"


def _num(value: float | None, spec: str, none: str = "—") -> str:
    return none if value is None else format(value, spec)


def epsilon_text(value: float | None, delta: float | None = None) -> str:
    text = _num(value, ".2f", none="n/a")
    return text if value is None or delta is None else f"{text} (δ={delta:g})"


def _decision(line: RoundLine) -> str:
    if line.decision == "accepted" and line.selected is False:
        return "accepted, not selected"
    return line.decision


def _totals(statement: Statement, verification: Verification | None) -> list[str]:
    """The cells of the totals row, shared by the table and the HTML page."""
    t = statement.totals
    totals = [
        "total",
        f"{t.accepted} accepted, {t.rejected} rejected",
        f"{t.rewarded} of {t.rounds} round(s) rewarded",
        "",
        money(t.amount),
        f"{statement.reputation:.3f}",
        epsilon_text(t.epsilon, t.epsilon_delta),
    ]
    if verification is not None:
        n = verification.counts
        totals.append(f"{n['ok']}/{n['ok'] + n['failed'] + n['pending']}")
    return totals


def render_table(statement: Statement, verification: Verification | None = None) -> Table:
    """The statement as a rich table, totals in the last row."""
    s = statement
    table = Table(
        title=f"rewards of {s.name} ({s.contributor_id[:12]}, {s.status})",
        caption=f"reputation now {s.reputation:.3f}",
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("round", "right"),
        ("decision", "left"),
        ("why", "left"),
        ("quality", "right"),
        ("reward", "right"),
        ("reputation", "right"),
        ("ε", "right"),
    )
    for name, justify in columns:
        table.add_column(name, justify=justify)
    if verification is not None:
        table.add_column("ledger", justify="center")
    for line in s.rounds:
        cells = [
            str(line.round),
            _decision(line),
            line.why,
            _num(line.quality, "+.4f"),
            money(line.amount),
            _num(line.reputation_after, ".3f"),
            epsilon_text(line.epsilon),
        ]
        if verification is not None:
            cells.append(verification.checks[line.round].mark)
        table.add_row(*cells, style="red" if line.decision == "rejected" else None)
    table.add_section()
    totals = _totals(statement, verification)
    table.add_row(*totals, style="bold")
    return table


def to_json(statement: Statement, verification: Verification | None = None) -> str:
    """The report as served, plus each round's check and a summary when verified."""
    body = dict(statement.raw)
    if verification is not None:
        rows = []
        for row in body.get("rounds", []):
            check = verification.checks[int(row["round"])]
            rows.append({**row, "verified": check.status, "verify_detail": check.detail})
        body["rounds"] = rows
        body["verification"] = verification.as_dict()
    return json.dumps(body, indent=2, ensure_ascii=False) + "\n"


CSV_COLUMNS = (
    "round",
    "round_status",
    "decision",
    "reason",
    "reward_reason",
    "selected",
    "score",
    "quality",
    "reward",
    "reputation_after",
    "epsilon",
    "log_index",
    "verified",
)


def to_csv(statement: Statement, verification: Verification | None = None) -> str:
    """One row per round, then a row whose round is "total"; exact amounts; empty cells for
    missing values (no epsilon, not scored)."""

    def cell(value: Any) -> Any:
        return "" if value is None else value

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for line in statement.rounds:
        check = verification.checks[line.round].status if verification is not None else None
        values = (
            line.round,
            line.round_status,
            line.decision,
            line.reason,
            line.reward_reason,
            line.selected,
            line.score,
            line.quality,
            exact(line.amount),
            line.reputation_after,
            line.epsilon,
            line.log_index,
            check,
        )
        writer.writerow([cell(v) for v in values])
    t = statement.totals
    summary = None if verification is None else ("ok" if verification.ok else "failed")
    totals = ("total", None, f"{t.accepted} accepted", f"{t.rejected} rejected", None)
    writer.writerow(
        [cell(v) for v in totals]
        + ["", "", "", exact(t.amount), statement.reputation, cell(t.epsilon), "", cell(summary)]
    )
    return out.getvalue()


ACCEPTED_COLOUR, REJECTED_COLOUR, QUALITY_COLOUR = "#2a9d8f", "#e76f51", "#264653"


def plot_svg(statement: Statement) -> str:
    """Rewards (bars) and quality (line, right axis) per round as an inline SVG element."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    lines = statement.rounds
    rounds = [line.round for line in lines]
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.add_subplot()
    colours = [ACCEPTED_COLOUR if x.decision == "accepted" else REJECTED_COLOUR for x in lines]
    ax.bar(rounds, [float(x.amount) for x in lines], width=0.6, color=colours)
    rejected = [x.round for x in lines if x.decision != "accepted"]
    ax.scatter(rejected, [0.0] * len(rejected), marker="x", color=REJECTED_COLOUR, zorder=3)
    ax.set_xlabel("round")
    ax.set_ylabel("reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(axis="y", alpha=0.3)
    quality = ax.twinx()
    values = [math.nan if x.quality is None else x.quality for x in lines]
    quality.plot(rounds, values, color=QUALITY_COLOUR, marker="o", linewidth=1.5)
    quality.set_ylabel("quality")
    handles = [
        Patch(color=ACCEPTED_COLOUR, label="reward (accepted)"),
        Line2D([], [], color=REJECTED_COLOUR, marker="x", linestyle="", label="rejected"),
        Line2D([], [], color=QUALITY_COLOUR, marker="o", label="quality"),
    ]
    quality.axhline(0.0, color=QUALITY_COLOUR, linewidth=0.6, linestyle=":")
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncols=3,
        frameon=False,
        fontsize="small",
    )
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "zoo-gym"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 color:#1d2733;background:#fff;max-width:1100px;margin:2rem auto;padding:0 1rem}
h1{font-size:1.5rem;margin:0 0 .3rem}
.meta{color:#5b6b7b;margin:0 0 1rem;font-size:.9rem}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.cards{display:flex;flex-wrap:wrap;gap:.8rem;margin:1rem 0}
.card{border:1px solid #d8dee4;border-radius:8px;padding:.5rem .9rem;min-width:8.5rem}
.card span{color:#5b6b7b;font-size:.8rem}.card b{display:block;font-size:1.25rem}
.banner{padding:.6rem 1rem;border-radius:6px;margin:1rem 0;font-weight:600}
.banner.ok{background:#e6f4ea;color:#1e6b34}.banner.failed{background:#fdecea;color:#a02323}
.banner.pending{background:#fff6e0;color:#7a5a00}
figure{margin:1rem 0}figure svg{width:100%;height:auto}
figcaption{color:#5b6b7b;font-size:.85rem}
table{border-collapse:collapse;width:100%;font-size:.9rem}
th,td{padding:.35rem .6rem;border-bottom:1px solid #e3e8ee;text-align:left;vertical-align:top}
th{background:#f3f5f7}.num{text-align:right;font-variant-numeric:tabular-nums}
tr.rejected td{color:#a02323}
tfoot td{font-weight:700;border-top:2px solid #1d2733;border-bottom:none}
.mark{text-align:center;font-weight:700}.mark.ok{color:#1e6b34}.mark.failed{color:#a02323}
.mark.pending{color:#7a5a00}.mark.none{color:#9aa5b1}
"""


def _cards(statement: Statement) -> str:
    s, t = statement, statement.totals
    cards = (
        ("total reward", money(t.amount)),
        ("rounds", str(t.rounds)),
        ("accepted / rejected", f"{t.accepted} / {t.rejected}"),
        ("rewarded rounds", str(t.rewarded)),
        ("reputation", f"{s.reputation:.3f}"),
        ("privacy spent (ε)", epsilon_text(t.epsilon, t.epsilon_delta)),
    )
    items = "".join(
        f'<div class="card"><span>{html.escape(k)}</span><b>{html.escape(v)}</b></div>'
        for k, v in cards
    )
    return f'<div class="cards">{items}</div>'


def _banner(verification: Verification | None) -> str:
    if verification is None:
        return ""
    if not verification.ok:
        kind = "failed"
    elif verification.counts["pending"] or verification.size == 0:
        kind = "pending"
    else:
        kind = "ok"
    text = ("✓ " if kind == "ok" else "✗ " if kind == "failed" else "… ") + verification.summary()
    return f'<p class="banner {kind}">{html.escape(text)}</p>'


def _rows(statement: Statement, verification: Verification | None) -> str:
    rows = []
    for line in statement.rounds:
        cells = [
            f'<td class="num">{line.round}</td>',
            f"<td>{html.escape(_decision(line))}</td>",
            f"<td>{html.escape(line.why)}</td>",
            f'<td class="num">{_num(line.quality, "+.4f")}</td>',
            f'<td class="num" title="{exact(line.amount)}">{money(line.amount)}</td>',
            f'<td class="num">{_num(line.reputation_after, ".3f")}</td>',
            f'<td class="num">{epsilon_text(line.epsilon)}</td>',
        ]
        if verification is not None:
            check = verification.checks[line.round]
            cells.append(
                f'<td class="mark {check.status}" title="{html.escape(check.detail)}">'
                f"{check.mark}</td>"
            )
        kind = "rejected" if line.decision == "rejected" else "accepted"
        rows.append(f'<tr class="{kind}">{"".join(cells)}</tr>')
    return "\n".join(rows)


def to_html(
    statement: Statement, verification: Verification | None = None, *, source: str = ""
) -> str:
    """A self-contained page (inline CSS and SVG, nothing fetched): summary, verification status,
    a plot of rewards and quality per round, the table and its totals."""
    s = statement
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = ["round", "decision", "why", "quality", "reward", "reputation", "ε"]
    if verification is not None:
        head.append("ledger")
    align = ["num", "", "", "num", "num", "num", "num", "mark"][: len(head)]
    header = "".join(
        f'<th class="{a}">{html.escape(h)}</th>' for a, h in zip(align, head, strict=True)
    )
    totals = _totals(statement, verification)
    foot = "".join(
        f'<td class="{a}">{html.escape(v)}</td>' for a, v in zip(align, totals, strict=True)
    )
    figure = (
        f"<figure>{plot_svg(s)}<figcaption>Reward (bars) and contribution quality (line, right "
        "axis) per round.</figcaption></figure>"
        if s.rounds
        else "<p>No rounds yet.</p>"
    )
    where = f" · from {html.escape(source)}" if source else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>zoo-gym rewards: {html.escape(s.name)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>Reward statement of {html.escape(s.name)}</h1>
<p class="meta">contributor <code>{html.escape(s.contributor_id)}</code> · {html.escape(s.status)}{where} · generated {generated}</p>
{_cards(s)}
{_banner(verification)}
{figure}
<table>
<thead><tr>{header}</tr></thead>
<tbody>
{_rows(s, verification)}
</tbody>
<tfoot><tr>{foot}</tr></tfoot>
</table>
</body>
</html>
"""
