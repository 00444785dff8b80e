"""Confirmations: each a ``ModalScreen[bool]`` returned through ``dismiss``; Escape means False.

* :class:`TopologyConfirmScreen` — a topology change. Shows its topology changes in words (always in
  sight) above the whole plan (scrolling), and stays unconfirmable until the deployment's name is typed exactly (as Terraform
  accepts only ``yes``). Enter on a wrong name refuses and says so; nothing is applied.
* :class:`YesNoScreen` — a disruptive change (y/N: it restarts serving roles).

Each has its own footer, listing its own keys: the console's footer under it would offer keys that do nothing while
it is open.

They decide nothing: the caller applies the plan id it showed, and the engine re-checks it.
"""

from __future__ import annotations

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Input, Static

from pdctl.console._plan import render_plan
from pdctl.statemachine.plan import Plan

__all__ = ["TopologyConfirmScreen", "YesNoScreen"]


class TopologyConfirmScreen(ModalScreen[bool]):
    """Confirm a topology change by typing the deployment's name."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    """
    | Key(s) | Description |
    | :- | :- |
    | escape | Cancel: nothing changes. |
    | enter | Confirm (only when the typed name matches). |
    """

    DEFAULT_CSS = """
    TopologyConfirmScreen {
        align: center middle;
        & > #dialog {
            width: 100%;
            max-width: 100;
            height: auto;
            max-height: 100%;
            border: thick $error;
            background: $surface;
            padding: 0 1;
        }
        #title { text-style: bold; color: $error; }
        #changes { color: $error; text-style: bold; height: auto; }
        #plan { height: auto; max-height: 40vh; min-height: 3; border: round $primary-darken-2; }
        #ask { margin-top: 0; }
        #why { color: $error; height: auto; display: none; }
        .warnings { color: $warning; margin-bottom: 1; }
        #buttons { height: 3; align-horizontal: right; }
        #buttons > Button { margin-left: 1; }
    }
    """

    def __init__(self, plan: Plan, name_to_type: str | None = None, *, warnings: str = "") -> None:
        super().__init__()
        self.plan = plan
        self.expected = name_to_type or plan.deployment
        self.warnings = warnings

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(f"Topology change to deployment {self.expected!r} — plan {self.plan.plan_id}", id="title")
            # The changes in words stay in sight at any terminal size (80×24 included); the full plan scrolls.
            yield Static(Text("\n".join(f"! {w}" for w in self.plan.topology_changes)), id="changes")
            with VerticalScroll(id="plan"):
                if self.warnings:
                    yield Static(self.warnings, classes="warnings")
                yield Static(render_plan(self.plan))
            yield Static(f"Type [b]{self.expected}[/b] to apply this plan; Escape cancels, nothing changes.", id="ask")
            yield Input(placeholder="deployment name", id="name")
            yield Static("", id="why")
            with Horizontal(id="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("Apply topology change", id="confirm", variant="error", disabled=True)
        yield Footer()  # this dialog's keys, over the console's (whose keys do nothing while it is open)

    def on_mount(self) -> None:
        self.query_one("#name", Input).focus()

    @property
    def matches(self) -> bool:
        return self.query_one("#name", Input).value == self.expected

    @on(Input.Changed, "#name")
    def _typed(self, _event: Input.Changed) -> None:
        self.query_one("#confirm", Button).disabled = not self.matches
        self.query_one("#why", Static).display = False

    @on(Input.Submitted, "#name")
    def _submitted(self, event: Input.Submitted) -> None:
        if self.matches:
            self.dismiss(True)
        else:
            why = self.query_one("#why", Static)
            why.update(f"{event.value!r} is not {self.expected!r}: not applied (Escape cancels)")
            why.display = True

    @on(Button.Pressed, "#confirm")
    def _confirm(self) -> None:
        if self.matches:
            self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def _cancel_button(self) -> None:
        self.dismiss(False)

    def action_cancel(self) -> None:
        self.dismiss(False)


class YesNoScreen(ModalScreen[bool]):
    """A y/N question (default No)."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]
    """
    | Key(s) | Description |
    | :- | :- |
    | y | Yes. |
    | n, escape | No (nothing changes). |
    """

    DEFAULT_CSS = """
    YesNoScreen {
        align: center middle;
        & > #dialog {
            width: 100%;
            max-width: 90;
            height: auto;
            max-height: 100%;
            border: thick $warning;
            background: $surface;
            padding: 0 1;
        }
        #question { text-style: bold; }
        #detail { height: auto; max-height: 14; }
        #buttons { height: 3; align-horizontal: right; }
        #buttons > Button { margin-left: 1; }
    }
    """

    def __init__(self, question: str, detail: object = "") -> None:
        super().__init__()
        self.question = question
        self.detail = detail

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(self.question + " [y/N]", id="question")
            with VerticalScroll(id="detail"):
                yield Static(self.detail)  # type: ignore[arg-type]
            with Horizontal(id="buttons"):
                yield Button("No", id="no")
                yield Button("Yes", id="yes", variant="warning")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def _no(self) -> None:
        self.dismiss(False)

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
